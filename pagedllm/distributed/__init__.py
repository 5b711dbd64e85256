"""Ranks of a model split over processes: which layers each pipeline stage holds, and how
activations pass between stages (torch.distributed point-to-point)."""
