"""Quantized weights: decoded to one group-affine form (group_quant), then repacked for a kernel."""
