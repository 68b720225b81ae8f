"""lightray: ImageNet-class training at record speed on a Ray cluster of spot GPU machines."""
