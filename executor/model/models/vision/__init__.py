"""Vision-language models: their families (llava, idefics3, qwen2_vl, qwen2_5_vl over a registered language
model), the base they share (vlm.py) and their vision encoders (the towers the language models read image
features from)."""
