"""Gradient communication between the training workers: the DDP communication hook and its modes (``hook``:
dense, fp16/bf16, top-k with error feedback, hierarchical top-k; ``powersgd``), the crossover model that picks one
(``auto``), top-k selection and payloads (``compress``), DGC's accuracy units (``dgc``), adaptive bucket sizes
(``fusion``), where each rank sits (``topology``) and BatchNorm over the global batch (``global_bn``)."""
