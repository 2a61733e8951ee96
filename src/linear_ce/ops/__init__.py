"""The ``torch.library`` custom ops of each head family, their fakes, autograd and vmap."""
