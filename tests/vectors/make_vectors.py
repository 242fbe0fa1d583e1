"""hurraykv's own block-paged vectors: the single source for tests/vectors/*.bin and
manifest.json, and for the reject tests (one minimal mutation per checklist row).

Run ``python tests/vectors/make_vectors.py`` to rewrite the files; the test suite checks
that the committed files still equal what this module builds.

Valid vectors are descriptors alone (``.bin``).  An invalid vector whose rule needs the
index buffers is stored in the streaming form (descriptor, then each buffer's bytes,
decision D8) with ``"with_buffers": true``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

import hurraykv as hk
from hurraykv.wire.buffers import BufferHandle
from hurraykv.wire.descriptor import TensorDescriptor
from hurraykv.wire.layouts import BlockPaged
from hurraykv.wire.quantization import NF4, PerBlockAffine, PerChannel, PerTensor
from hurraykv.wire.sections import CompositeMember, Shard

HERE = Path(__file__).parent
F16, INT8, INT4 = 0x01, 0x10, 0x48


def handles(*sizes: int, **kw: int) -> tuple[BufferHandle, ...]:
    return tuple(BufferHandle(s, **kw) for s in sizes)


# The spec's worked example: layer 3 key, 2 sequences, page_size 4, 5 pages, 2 heads,
# head_dim 8, float16, uint32 indices; seq_ptr [0, 2, 3], block_table [0, 1, 0].
WORKED = TensorDescriptor(F16, (9, 2, 8), BlockPaged(4, 5, 2, 0, 3, 0), handles(640, 12, 12))
WORKED_BUFFERS = (
    np.arange(320, dtype="<f2").tobytes(),
    np.array([0, 1, 0], "<u4").tobytes(),
    np.array([0, 2, 3], "<u4").tobytes(),
)
# Quantized base: int8 pool, symmetric per-block-affine, one f32 scale per page slot.
QUANT = TensorDescriptor(INT8, (9, 2, 8), BlockPaged(4, 5, 2, 0, 3, 0),
                         handles(320, 12, 12, 80), quantization=PerBlockAffine(0, 4, 3))


def mutate(desc: TensorDescriptor | bytes, offset: int, fmt: str, value: int) -> bytes:
    """Overwrite one field in the encoded bytes (a minimal byte-level mutation)."""
    raw = bytearray(desc if isinstance(desc, bytes) else desc.encode())
    struct.pack_into("<" + fmt, raw, offset, value)
    return bytes(raw)


def stream(desc: TensorDescriptor, buffers: tuple[bytes, ...]) -> bytes:
    return desc.encode() + b"".join(buffers)


def with_index(bt: list[int], sp: list[int]) -> bytes:
    b = (WORKED_BUFFERS[0], np.array(bt, "<u4").tobytes(), np.array(sp, "<u4").tobytes())
    d = replace(WORKED, layout=replace(WORKED.layout, num_seqs=len(sp) - 1),
                buffers=handles(640, 4 * len(bt), 4 * len(sp)))
    return stream(d, b)


VALID: dict[str, tuple[str, TensorDescriptor]] = {
    "worked_example_f16_key_layer3": ("The spec's worked example", WORKED),
    "uint64_index_value_layer0": (
        "Value role, layer 0, uint64 block_table/seq_ptr",
        TensorDescriptor(F16, (9, 2, 8), BlockPaged(4, 5, 2, 1, 0, 1), handles(640, 24, 24))),
    "fused_not_layer_scoped_bf16": (
        "Fused role, not layer-scoped (0xFFFFFFFF), bfloat16, page_size 16",
        TensorDescriptor(0x02, (20, 4, 64), BlockPaged(16, 3, 2, 2, None, 0),
                         handles(3 * 16 * 4 * 64 * 2, 8, 12))),
    "empty_batch": (
        "Empty batch: num_seqs 0, empty block_table, seq_ptr [0]",
        TensorDescriptor(F16, (0, 2, 8), BlockPaged(4, 0, 0, 0, 0, 0),
                         (BufferHandle(0), BufferHandle(0, alignment=1), BufferHandle(4)))),
    "int8_per_block_affine": ("int8 pool, per-block-affine per-page-slot f32 scales", QUANT),
    "int4_per_tensor": (
        "int4 pool (byte-aligned pages), per-tensor scale 0.0125",
        TensorDescriptor(INT4, (9, 2, 8), BlockPaged(4, 5, 2, 0, 3, 0), handles(160, 12, 12),
                         quantization=PerTensor(0.0125))),
    "int8_per_channel_heads_asym": (
        "int8 pool, asymmetric per-channel on axis 1 (heads), scales at 3, zero-points at 4",
        TensorDescriptor(INT8, (9, 2, 8), BlockPaged(4, 5, 2, 0, 3, 0),
                         handles(320, 12, 12, 8, 8), quantization=PerChannel(1, 3, 4))),
}


@dataclass(frozen=True)
class Invalid:
    row: str
    error: type
    data: bytes
    with_buffers: bool = False
    permissive_ok: bool = False  # the spec lets a permissive reader accept it
    field: str = ""


W = WORKED.encode()
BT0 = 84 + 1  # first buffer handle (rank 3: 20 + 24 + 8 + 32 = 84 is buffer_count)


def _h(i: int) -> int:
    return BT0 + 16 * i


QOFF = BT0 + 16 * 4 + 4  # scheme_tag of QUANT (4 buffers, then quantization_length)


def _short_per_tensor() -> bytes:
    """A per-tensor section cut to 12 of its 16 bytes, lengths adjusted to match."""
    enc = replace(QUANT, quantization=PerTensor(1.0), buffers=QUANT.buffers[:3]).encode()
    q = BT0 + 16 * 3  # quantization_length
    out = enc[:q] + struct.pack("<I", 12) + enc[q + 4:q + 16] + enc[q + 20:]
    return mutate(out, 6, "I", len(out))


INVALID: dict[str, Invalid] = {
    "r01_bad_magic": Invalid("1", hk.DescriptorError, b"HRRX" + W[4:], field="magic"),
    "r01_major_2": Invalid("1", hk.DescriptorError, mutate(W, 4, "B", 2), field="version_major"),
    "r01_length_19": Invalid("1", hk.DescriptorError, mutate(W, 6, "I", 19),
                             field="descriptor_length"),
    "r01_reserved_flag": Invalid("1", hk.DescriptorError, mutate(W, 10, "I", 1 << 5),
                                 field="flags"),
    "r01_rank_65": Invalid("1", hk.DescriptorError, mutate(W, 16, "I", 65), field="rank"),
    "r02_truncated_payload": Invalid("2", hk.DescriptorError, mutate(W[:70], 6, "I", 70),
                                     field="layout"),
    "r03_reserved_nonzero": Invalid("3", hk.LayoutError, mutate(W, 52 + 26, "B", 1),
                                    field="layout._reserved"),
    "r04_kv_role_3": Invalid("4", hk.LayoutError, mutate(W, 72, "B", 3), field="layout.kv_role"),
    "r05_index_type_2": Invalid("5", hk.LayoutError, mutate(W, 77, "B", 2),
                                field="layout.block_table_index_type"),
    "r06_no_buffers": Invalid("6", hk.BufferError, replace(WORKED, buffers=()).encode(),
                              field="buffer_count"),
    "r07_two_buffers": Invalid("7", hk.BufferError, replace(
        WORKED, buffers=WORKED.buffers[:2]).encode(), field="buffer_count"),
    "r08_alignment_48": Invalid("8", hk.BufferError, mutate(W, _h(0) + 8, "I", 48),
                                field="buffers[0].alignment"),
    "r08_alignment_32": Invalid("8", hk.BufferError, mutate(W, _h(1) + 8, "I", 32),
                                field="buffers[1].alignment"),
    "r08_device_reserved": Invalid("8", hk.BufferError, mutate(W, _h(0) + 12, "B", 0x09),
                                   field="buffers[0].device_tag"),
    "r08_sync_mode_3": Invalid("8", hk.BufferError, mutate(W, _h(0) + 13, "B", 3),
                               field="buffers[0].sync_mode"),
    "r08_cpu_event_sync": Invalid("8", hk.BufferError, mutate(W, _h(2) + 13, "B", 1),
                                  field="buffers[2].sync_mode"),
    "r08_memory_class_4": Invalid("8", hk.BufferError, mutate(W, _h(0) + 14, "B", 4),
                                  field="buffers[0].memory_class"),
    "r08_handle_reserved": Invalid("8", hk.BufferError, mutate(W, _h(0) + 15, "B", 1),
                                   field="buffers[0].reserved"),
    "r09_device_mismatch": Invalid("9", hk.BufferError, mutate(W, _h(1) + 12, "B", 1),
                                   field="buffers[1].device_tag"),
    "r10_cpu_peer": Invalid("10", hk.BufferError, replace(
        WORKED, buffers=handles(640, 12, 12, memory_class=3)).encode(),
        field="buffers[0].memory_class"),
    "r11_shard": Invalid("11", hk.LayoutError, replace(
        WORKED, shard=Shard((9, 2, 8), (0, 0, 0))).encode(), field="flags"),
    "r12_rank_2": Invalid("12", hk.LayoutError, replace(WORKED, shape=(9, 16)).encode(),
                          field="rank"),
    "r13_paged_axis_1": Invalid("13", hk.LayoutError, mutate(W, 64, "I", 1),
                                permissive_ok=True, field="layout.paged_axis"),
    "r14_page_size_0": Invalid("14", hk.LayoutError, mutate(W, 52, "I", 0),
                               field="layout.page_size"),
    "r15_byte_offset": Invalid("15", hk.LayoutError, mutate(W, 44, "Q", 64), field="byte_offset"),
    "r16_seq_ptr_size": Invalid("16", hk.BufferError, mutate(W, _h(2), "Q", 16),
                                permissive_ok=True, field="buffers[2].byte_size"),
    "r17_seq_ptr_start": Invalid("17", hk.LayoutError, with_index([0, 1, 0], [1, 2, 3]),
                                 with_buffers=True, field="seq_ptr[0]"),
    "r18_seq_ptr_decreasing": Invalid("18", hk.LayoutError, with_index([0, 1, 0], [0, 4, 3]),
                                      with_buffers=True, field="seq_ptr[2]"),
    "r19_seq_ptr_end": Invalid("19", hk.LayoutError, with_index([0, 1, 0], [0, 2, 2]),
                               with_buffers=True, field="seq_ptr[2]"),
    "r20_page_id_bound": Invalid("20", hk.LayoutError, with_index([0, 5, 0], [0, 2, 3]),
                                 with_buffers=True, field="block_table[1]"),
    "r21_block_table_size": Invalid("21", hk.BufferError, mutate(W, _h(1), "Q", 10),
                                    field="buffers[1].byte_size"),
    "r22_page_pool_size": Invalid("22", hk.BufferError, mutate(W, _h(0), "Q", 600),
                                  field="buffers[0].byte_size"),
    "r23_uint32_too_many_pages": Invalid("23", hk.LayoutError, replace(
        WORKED, layout=replace(WORKED.layout, num_pages=1 << 32),
        buffers=handles((1 << 32) * 4 * 2 * 8 * 2, 12, 12)).encode(),
        field="layout.block_table_index_type"),
    "r24_scheme_reserved": Invalid("24", hk.QuantizationError,
                                   mutate(QUANT.encode(), QOFF, "B", 0x60),
                                   field="q.scheme_tag"),
    "r24_scheme_unknown": Invalid("24", hk.QuantizationError,
                                  mutate(QUANT.encode(), QOFF, "B", 0x06),
                                  permissive_ok=True, field="q.scheme_tag"),
    "r24_scheme_private": Invalid("24", hk.QuantizationError,
                                  mutate(QUANT.encode(), QOFF, "B", 0xF0),
                                  permissive_ok=True, field="q.scheme_tag"),
    "r24_scheme_version_2": Invalid("24", hk.QuantizationError,
                                    mutate(QUANT.encode(), QOFF + 1, "B", 2),
                                    field="q.scheme_version"),
    "r24_reserved_flags": Invalid("24", hk.QuantizationError,
                                  mutate(QUANT.encode(), QOFF + 2, "H", 3),
                                  field="q.flags"),
    "r24_too_short": Invalid("24", hk.QuantizationError, _short_per_tensor(),
                             field="quantization_length"),
    "r25_per_channel_axis_0": Invalid("25", hk.QuantizationError, replace(
        QUANT, quantization=PerChannel(0, 3), buffers=handles(320, 12, 12, 36)).encode(),
        field="q.axis"),
    "r26_per_block_axis_1": Invalid("26", hk.QuantizationError, replace(
        QUANT, quantization=PerBlockAffine(1, 4, 3)).encode(), field="q.axis"),
    "r26_block_size_8": Invalid("26", hk.QuantizationError, replace(
        QUANT, quantization=PerBlockAffine(0, 8, 3)).encode(), field="q.block_size"),
    "r27_page_size_3": Invalid("27", hk.QuantizationError, replace(
        QUANT, layout=replace(QUANT.layout, page_size=3), shape=(6, 2, 8),
        buffers=handles(240, 12, 12, 60), quantization=PerBlockAffine(0, 3, 3)).encode(),
        field="q.block_size"),
    "r28_axis_ge_rank": Invalid("28", hk.QuantizationError, replace(
        QUANT, quantization=PerChannel(3, 3), buffers=handles(320, 12, 12, 8)).encode(),
        field="q.axis"),
    "r28_storage_float16": Invalid("28", hk.QuantizationError, replace(
        WORKED, quantization=PerTensor(0.5)).encode(), field="type_tag"),
    "r28_zero_point_range": Invalid("28", hk.QuantizationError, replace(
        QUANT, quantization=PerTensor(0.5, 200), buffers=QUANT.buffers[:3]).encode(),
        field="q.zero_point"),
    "r29_param_index_2": Invalid("29", hk.QuantizationError, replace(
        QUANT, quantization=PerBlockAffine(0, 4, 2)).encode(), field="q.scale_buffer_index"),
    "r29_param_index_out_of_table": Invalid("29", hk.QuantizationError, replace(
        QUANT, quantization=PerBlockAffine(0, 4, 4)).encode(), field="q.scale_buffer_index"),
    "r30_scale_buffer_size": Invalid("30", hk.QuantizationError, replace(
        QUANT, buffers=handles(320, 12, 12, 72)).encode(), field="buffers[3].byte_size"),
    "r31_per_tensor_scale_zero": Invalid("31", hk.QuantizationError, replace(
        QUANT, quantization=PerTensor(0.0), buffers=QUANT.buffers[:3]).encode(),
        field="q.scale"),
    "r31_scale_array_zero": Invalid(
        "31", hk.QuantizationError,
        stream(QUANT, (bytes(320), np.array([0, 1, 0], "<u4").tobytes(),
                       np.array([0, 2, 3], "<u4").tobytes(),
                       np.r_[np.ones(7), 0.0, np.ones(12)].astype("<f4").tobytes())),
        with_buffers=True, field="scales[7]"),
    "r32_nf4_on_block_paged": Invalid("32", hk.QuantizationError, replace(
        QUANT, type_tag=0x49, buffers=handles(160, 12, 12, 4),
        quantization=NF4(1, 2, 3)).encode(), permissive_ok=True, field="q.scheme_tag"),
    "r33_dynamic_heads": Invalid("33", hk.LayoutError, mutate(W, 28, "Q", (1 << 64) - 1),
                                 field="shape[1]"),
    "r34_too_many_tokens": Invalid("34", hk.LayoutError, mutate(W, 20, "Q", 13),
                                   field="shape[0]"),
    "r35_composite_member": Invalid("35", hk.LayoutError, replace(
        WORKED, composite_member=CompositeMember(1)).encode(), field="flags"),
    "d11_int4_unaligned_page": Invalid("D11", hk.UnsupportedError, TensorDescriptor(
        INT4, (1, 1, 1), BlockPaged(1, 1, 1, 0, 0, 0), handles(1, 4, 8)).encode(),
        field="layout.page_size"),
}


def _error_name(error: type) -> str:
    """The manifest's name of an error class: hk.HurrayBufferError keeps the name the
    vectors were published with (BufferError, still an alias of it in hurraykv)."""
    return "BufferError" if error is hk.HurrayBufferError else error.__name__


def manifest() -> dict:
    from hurraykv.wire.annotate import to_json

    return {
        "format_version": "1.0",
        "descriptors": [
            {"file": f"{name}.bin", "description": text, "expect": to_json(d)}
            for name, (text, d) in VALID.items()
        ],
        "invalid": [
            {"file": f"{name}.bin", "row": v.row, "error": _error_name(v.error), "field": v.field,
             "with_buffers": v.with_buffers, "permissive_ok": v.permissive_ok}
            for name, v in INVALID.items()
        ],
    }


def files() -> dict[str, bytes]:
    out = {f"{name}.bin": d.encode() for name, (_, d) in VALID.items()}
    out |= {f"invalid/{name}.bin": v.data for name, v in INVALID.items()}
    out["manifest.json"] = (json.dumps(manifest(), indent=2) + "\n").encode()
    return out


if __name__ == "__main__":
    (HERE / "invalid").mkdir(exist_ok=True)
    for rel, data in files().items():
        (HERE / rel).write_bytes(data)
    print(f"wrote {len(files())} files under {HERE}")
