"""The comm modes, one module each behind ``base.CommMode`` (laid out as torch's ``ddp_comm_hooks``): ``dense``
(dense, fp16, bf16, and a single worker's identity), ``topk``, ``hierarchical`` (hierarchical top-k), ``powersgd``;
``sparse`` holds the DGC steps both top-k modes share."""
