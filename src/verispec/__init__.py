"""verispec: lossless speculative-decoding inference on PyTorch."""

__version__ = "0.1.0"
