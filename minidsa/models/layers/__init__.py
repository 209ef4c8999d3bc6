"""The model's building blocks: FP8 block-scaled linear layers and the tensor-parallel layers."""
