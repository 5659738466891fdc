"""The split-K and small 4-bit kernels' modelled traffic for 2 to 32 rows of A (docs/small-batch.md): the
slices of K the split-K kernel takes, and which of the two kernels is the built-in route. Counts per
output column (weight row) of the lines the emulator's profile charges (bnb_mps.emulator.profile),
from the shapes alone; nothing here looks at tensor data or at Metal."""

from __future__ import annotations

import functools

_SMALL_ROWS_PER_TG = 16  # weight rows per threadgroup in the small kernel (all M rows of A)
_SPLITK_ALIGN = 256  # the split-K kernel's slices of K start at multiples of this


def built_in(M: int, K: int, itemsize: int, scale_bytes: int, blocksize: int, handover: bool = True) -> str:
    """"splitk", "splitk/two" or "small" for 2 <= M <= 32 rows of A of `itemsize` bytes and K >= 512, on
    a weight whose blocks of `blocksize` have scales of `scale_bytes` (1: nested 8-bit codes; 4: float32
    absmax): the one the cost model charges least, summed over the M of M's tuning bucket (powers of
    two: every M of a bucket has the same built-in route), "splitk" (one dispatch) only where the tier
    has it (`handover`: Metal >= 3.2); ties go to the first of that order. A split-K path but where a
    row's cuts share lines (K % 256 != 0 with phases that do not divide S) or float32 absmax is read by
    every slice, at M = 2 to 4."""
    top = 1 << (M - 1).bit_length()
    bucket = range(max(2, top // 2 + 1), top + 1)

    def total(dispatches: int) -> float:
        return sum(min(splitk_cost(m, K, itemsize, S, scale_bytes, blocksize, dispatches) for S in splits(K))
                   for m in bucket)  # fmt: skip

    costs = {"splitk": total(1)} if handover else {}
    costs["splitk/two"] = total(2)
    costs["small"] = sum(small_cost(m, K, itemsize, scale_bytes, blocksize) for m in bucket)
    return min(costs, key=costs.__getitem__)


def splitk_splits(M: int, K: int, itemsize: int, scale_bytes: int = 1, blocksize: int = 64) -> int:
    """S, the slices of K of the split-K kernel for M rows of A of element size `itemsize`, on a weight
    whose blocks of `blocksize` have scales of `scale_bytes` (1: nested 8-bit codes; 4: float32 absmax):
    of 2, 4, 8 and 16 (slices of 256 or more), the one the cost model charges least (`splitk_cost`,
    docs/small-batch.md). 1 where K < 512 (no split). The same S for one and two dispatches: their
    charges differ by a term that does not depend on S (the counter's line against a read of each
    output's own slot), so both paths add the same slices."""
    choices = splits(K)
    if not choices:
        return 1
    return min(choices, key=lambda S: splitk_cost(M, K, itemsize, S, scale_bytes, blocksize))


def splitk_threadgroups(N: int, S: int) -> int:
    """The split-K kernel's threadgroups for N weight rows in tiles of 16 S: S per tile, but the last
    tile, of g groups of 16 rows, takes the least power of two of slices not below g
    (gemm_4bit_splitk.h, "The last tile"). At least ceil(N / 16), half the gemv kernel's."""
    width = _SMALL_ROWS_PER_TG * S
    tiles = -(-N // width)
    groups = -(-(N - (tiles - 1) * width) // _SMALL_ROWS_PER_TG)
    return (tiles - 1) * S + (1 << (groups - 1).bit_length())


def splits(K: int) -> tuple[int, ...]:
    """The S the split-K kernel may take for K: 2, 4, 8, 16, slices of 256 or more."""
    return tuple(S for S in (2, 4, 8, 16) if K >= S * _SPLITK_ALIGN)


def phases(K: int) -> int:
    """P: weight row n starts (n K) % 256 weights into a 128-byte line, a phase that repeats every P
    rows (1 where K % 256 == 0; 256 / the lowest set bit of K % 256 otherwise)."""
    rest = K % _SPLITK_ALIGN
    return 1 if rest == 0 else _SPLITK_ALIGN // (rest & -rest)


def splitk_cost(M: int, K: int, itemsize: int, S: int, scale_bytes: int, blocksize: int,
                dispatches: int = 1) -> float:  # fmt: skip
    """The split-K kernels' modelled traffic per output column (weight row) but for the weight's own
    bytes and what every kernel with ceil(N / 16) threadgroups pays alike (the nested code table), in one
    dispatch (the last threadgroup of a tile adds the tile's slots) or two (`dispatches` = 2: every slot
    written, then read back whole by the sum kernel, which writes the output):
    - A: a tile of 16 S columns reads A's M rows once over its S slices, M x K x itemsize bytes, and
      where rows are cut where their own lines begin (P dividing S: gemm_4bit_splitk.h), each slice
      after the first widened by the largest phase;
    - partial sums: one dispatch, 2 S - 1 of 4 bytes per row of A (S written, S - 1 read back by the
      threadgroup that adds them, its own still in its cache); two dispatches, 2 S (S written, S read
      by the sum kernel);
    - the output: a tile writes a row's 16 S columns as whole lines (a tile narrower than a line
      writes a line's worth: 32 columns of float16);
    - scales: the 128-byte lines of scales each slice's threadgroup touches (`scale_lines`);
    - the weight's lines read twice: where K % 256 != 0, the line that holds a row's end and the next
      row's start (in all rows but one of every P), and where P does not divide S, every cut inside a
      line; and in one dispatch the tile's counter, a line per threadgroup."""
    width = _SMALL_ROWS_PER_TG * S
    span = -(-K // (S * _SPLITK_ALIGN)) * _SPLITK_ALIGN
    cuts = -(-K // span) - 1  # between slices that are not empty
    P = phases(K)
    phased = P > 1 and S % P == 0
    a_cols = K + (cuts * (_SPLITK_ALIGN - _SPLITK_ALIGN // P) if phased else 0)
    shared = 128 * (1 - 1 / P) * (1 + (0 if phased else cuts))
    out = -(-width * itemsize // 128) * 128 / width
    if dispatches == 2:
        return M * (a_cols * itemsize / width + 4 * 2 * S + out) + scale_lines(K, S, scale_bytes, blocksize) + shared
    return (M * (a_cols * itemsize / width + 4 * (2 * S - 1) + out) + scale_lines(K, S, scale_bytes, blocksize)
            + shared + 128 / _SMALL_ROWS_PER_TG)  # fmt: skip


def small_cost(M: int, K: int, itemsize: int, scale_bytes: int, blocksize: int) -> float:
    """The small kernel's, counted as `splitk_cost` counts: A read whole by every threadgroup of 16
    rows; a line of the output per row of A and threadgroup; the scales once, and a line of them and
    (where K % 256 != 0) of the weight read by two threadgroups at each tile's end."""
    width = _SMALL_ROWS_PER_TG
    out = -(-width * itemsize // 128) * 128 / width
    edge = 128 / width
    return M * (K * itemsize / width + out) + K / blocksize * scale_bytes + edge * (2 - 1 / phases(K))


@functools.lru_cache(maxsize=256)
def scale_lines(K: int, S: int, scale_bytes: int, blocksize: int, line: int = 128) -> float:
    """The bytes of scale lines the split-K kernel's threadgroups touch per weight row: a tile's 16 S rows
    (the first tile's, from a line boundary) cut into slices of ceil(K / (256 S)) x 256; the slice of
    row n from k0 to k1 takes the scales of blocks (n K + k0) / blocksize to (n K + k1 - 1) /
    blocksize, `scale_bytes` each; every threadgroup touches the lines its rows' pieces meet. While a
    line holds several rows' scales, each slice touches all of them (the scales S times); where a row's
    scales span lines, about once plus a line per slice."""
    rows = _SMALL_ROWS_PER_TG * S
    span = -(-K // (S * _SPLITK_ALIGN)) * _SPLITK_ALIGN
    touched = 0
    for k0 in range(0, K, span):
        k1 = min(k0 + span, K)
        lines = set()
        for n in range(rows):
            first, last = (n * K + k0) // blocksize * scale_bytes, ((n * K + k1 - 1) // blocksize + 1) * scale_bytes
            lines.update(range(first // line, (last - 1) // line + 1))
        touched += len(lines)
    return touched * line / rows
