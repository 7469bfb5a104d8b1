"""The model and its weights: loading (HF folders, GGUF), the prompt layout around the knowledge,
the weight formats a step multiplies with (weights, stacked_products), what `auto` picks on this
machine (auto_weights), and which model families the lean step covers (families)."""
