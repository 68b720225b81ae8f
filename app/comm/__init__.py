"""Gradient communication between the training workers: the DDP communication hook (``hook``) and its modes, one
module each behind one interface (``modes``: dense, fp16/bf16, top-k with error feedback, hierarchical top-k,
PowerSGD), the state they share (``slots``: residuals and velocities; ``loss_scale``: the fp16 journal; ``wire``:
bytes per collective), the crossover model that picks one (``auto``), top-k selection and payloads (``compress``),
DGC's accuracy units (``dgc``), adaptive bucket sizes (``fusion``), where each rank sits (``topology``) and BatchNorm
over the global batch (``global_bn``)."""
