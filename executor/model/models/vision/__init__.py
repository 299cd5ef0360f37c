"""Vision encoders of multimodal models (the towers their language models read image features from)."""
