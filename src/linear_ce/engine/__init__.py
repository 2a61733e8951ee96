"""The chunked engine: the plan, GEMM backends, weight-gradient sums, the chunk loop, the
vocabulary pass, the logits transform and the contract a head implements."""
