"""The ggml tensor types a GGUF file can name: id, name, block size and bytes per block.

Sizes follow ggml's block structs (ggml-common.h); QK_K super-blocks hold 256 values.
Only some of these can be decoded (see ``engine.model.gguf.quants``); the rest are listed so a
file using them is read correctly and rejected with the type's name.
"""

from __future__ import annotations

from dataclasses import dataclass

QK_K = 256


@dataclass(frozen=True)
class GGMLType:
    id: int
    name: str
    block_size: int  # values per block
    type_size: int  # bytes per block

    def nbytes(self, n_values: int) -> int:
        return n_values // self.block_size * self.type_size


_TABLE = [
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 2 + 16),
    (3, "Q4_1", 32, 2 + 2 + 16),
    (6, "Q5_0", 32, 2 + 4 + 16),
    (7, "Q5_1", 32, 2 + 2 + 4 + 16),
    (8, "Q8_0", 32, 2 + 32),
    (9, "Q8_1", 32, 4 + 32),
    (10, "Q2_K", QK_K, 2 + 2 + QK_K // 16 + QK_K // 4),
    (11, "Q3_K", QK_K, 2 + QK_K // 4 + QK_K // 8 + 12),
    (12, "Q4_K", QK_K, 2 + 2 + 12 + QK_K // 2),
    (13, "Q5_K", QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    (14, "Q6_K", QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
    (15, "Q8_K", QK_K, 4 + QK_K + QK_K // 8),
    (16, "IQ2_XXS", QK_K, 2 + QK_K // 4),
    (17, "IQ2_XS", QK_K, 2 + QK_K // 4 + QK_K // 32),
    (18, "IQ3_XXS", QK_K, 2 + QK_K // 4 + QK_K // 8),
    (19, "IQ1_S", QK_K, 2 + QK_K // 8 + QK_K // 16),
    (20, "IQ4_NL", 32, 2 + 16),
    (21, "IQ3_S", QK_K, 2 + QK_K // 4 + QK_K // 8 + QK_K // 32 + 4),
    (22, "IQ2_S", QK_K, 2 + QK_K // 4 + QK_K // 16),
    (23, "IQ4_XS", QK_K, 2 + 2 + QK_K // 2 + QK_K // 64),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", QK_K, QK_K // 8 + QK_K // 16 + QK_K // 32),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", QK_K, 2 + 4 * 13),
    (35, "TQ2_0", QK_K, 2 + 64),
    (39, "MXFP4", 32, 1 + 16),
]

GGML_TYPES: dict[int, GGMLType] = {t[0]: GGMLType(*t) for t in _TABLE}
BY_NAME: dict[str, GGMLType] = {t.name: t for t in GGML_TYPES.values()}

# llama.cpp's `general.file_type` (LLAMA_FTYPE) ids, for a readable quant name.
FILE_TYPES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
    10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M",
    16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S",
    22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M",
    28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0",
    37: "TQ2_0", 38: "MXFP4_MOE",
}
