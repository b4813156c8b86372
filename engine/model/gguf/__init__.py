"""GGUF model files: our own parser, ggml block decoding and an mlx_lm model loader."""

from engine.model.gguf.loader import WEIGHT_FORMATS, LoadedModel, load_gguf
from engine.model.gguf.reader import GGUFFile, TensorInfo, read_gguf

__all__ = ["WEIGHT_FORMATS", "GGUFFile", "LoadedModel", "TensorInfo", "load_gguf", "read_gguf"]
