"""Triton kernels of the fused MX quantizer (launched by ``triton_quantizer``).

Every rule is written on integer fp32 bits, exactly as in ``torch_quantizer`` (see there
for the rules); elements round to nearest even by one fp32 addition (or the hardware
fp8 conversion, see ``encode``):

- ``quantize_last``: blocks along a contiguous last axis; a tile is ``(rows, blocks, B)``
  (E2M1: ``(blocks, rows, B / 8, 8)``).
- ``quantize_strided``: blocks along an axis followed by contiguous elements
  (``(outer, L, inner)``); a tile is ``(row threads, blocks, row registers, inner)``
  (``TILE_BLOCKS`` blocks of ``B`` rows). It can read its rows through
  a row map (-1 = a zero row): the grouped helpers use that to pad each group's rows to a
  multiple of 32 without materializing a padded copy.

The jit helpers ``widen``, ``block_amax``, ``scale_exponent``, ``block_scales`` and ``encode`` are public:
kernels that quantize on the way to another layout (the Triton backends' weight
preparation and quantize-and-decode passes) call them, so their results match this
quantizer bit for bit by construction.
"""

import triton
import triton.language as tl


@triton.jit
def scale_exponent(amax, RULE: tl.constexpr, EMAX: tl.constexpr, MAX_MANT: tl.constexpr, MBITS: tl.constexpr):
    """Unbiased E8M0 exponent from fp32 amax bits (see torch_quantizer.scale_exponent)."""
    e_field = amax >> 23
    if RULE == 0:  # floor
        exp = e_field - 127 - EMAX
    elif RULE == 1:  # rceil
        mant = amax & 0x7FFFFF
        exp = e_field - 127 - EMAX + (mant > MAX_MANT).to(tl.int32)
        exp = tl.where((exp == -126) & (mant == MAX_MANT + 1), -127, exp)
        exp = tl.where(e_field == 0, -127, exp)
    else:  # even
        rounded = tl.minimum(amax, 0x7F7FFFFF) + (1 << (22 - MBITS))
        exp = (rounded >> 23) - 127 - EMAX
    return tl.minimum(tl.maximum(exp, -127), 127)


@triton.jit
def widen(raw, BF16_BITS: tl.constexpr):
    """Loaded input -> fp32. bf16 arrives as its int16 bits and widens by a shift (exact
    for subnormals too, which Triton's interpreter flushes when it converts bf16)."""
    if BF16_BITS:
        x = (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = raw.to(tl.float32)
    return x


@triton.jit
def encode(
    v, MBITS: tl.constexpr, BIAS: tl.constexpr, MAX_VALUE: tl.constexpr, NBITS: tl.constexpr, NATIVE: tl.constexpr
):
    """fp32 values -> element codes (int32, sign in bit NBITS - 1), nearest even, saturating.

    The rounding is one fp32 addition: with e the element exponent of |v| (at least the
    smallest normal's), ``M = 2^(e + 23 - MBITS)`` has exactly the element grid's spacing
    as its ulp, so the IEEE round-to-nearest-even sum ``|v| + M`` lands on the grid, ties
    to the even grid index. The index is ``bits(sum) - bits(M)`` (a carry into the next
    binade included), and the code adds the exponent part. About a third of the integer
    work of shifting the rounding bits out by hand, which made the kernel compute-bound.

    ``NATIVE`` (fp8 on NVIDIA sm_89+): the hardware conversion (``cvt.rn.satfinite``,
    nearest even) of the value clamped to ±max, one instruction per two elements.
    """
    # One return at the end, no early returns inside constexpr branches (also in the helpers).
    if NATIVE:
        fp8: tl.constexpr = tl.float8e4nv if MBITS == 3 else tl.float8e5
        code = tl.clamp(v, -MAX_VALUE, MAX_VALUE).to(fp8).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        a = tl.minimum(tl.abs(v), MAX_VALUE)
        e_field = tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 128 - BIAS)  # fp32 field of 2^max(e, emin)
        magic = (e_field + (23 - MBITS)) << 23
        index = (a + magic.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True) - magic
        code = index + ((e_field - (128 - BIAS)) << MBITS)
        code = code | ((v.to(tl.int32, bitcast=True) >> (32 - NBITS)) & (1 << (NBITS - 1)))
    return code


@triton.jit
def block_amax(x, AXIS: tl.constexpr, AXIS2: tl.constexpr):
    """Largest magnitude bits over axes ``AXIS`` and then ``AXIS2`` (-1: none)."""
    amax = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=AXIS)
    if AXIS2 >= 0:
        amax = tl.max(amax, axis=AXIS2)
    return amax


@triton.jit
def block_scales(amax, RULE: tl.constexpr, EMAX: tl.constexpr, MAX_MANT: tl.constexpr, MBITS: tl.constexpr):
    """Per block, from its amax bits: (the power-of-two reciprocal of its scale, fp32;
    whether it holds NaN / Inf; its E8M0 scale byte, 255 for those blocks, whose codes are
    zeroed)."""
    exp = scale_exponent(amax, RULE, EMAX, MAX_MANT, MBITS)
    nonfinite = amax >= 0x7F800000
    return ((127 - exp) << 23).to(tl.float32, bitcast=True), nonfinite, tl.where(nonfinite, 255, exp + 127)


@triton.jit
def quantize_last(
    x_ptr,
    data_ptr,
    scale_ptr,
    rows,
    length,
    padded,
    col_tiles,
    BLOCK: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    TILE_BLOCKS: tl.constexpr,
    RULE: tl.constexpr,
    EMAX: tl.constexpr,
    MAX_MANT: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_VALUE: tl.constexpr,
    NBITS: tl.constexpr,
    BF16_BITS: tl.constexpr,
    NATIVE: tl.constexpr,
):
    pid = tl.program_id(0)
    row_tile = pid // col_tiles
    col_tile = pid % col_tiles
    r1 = (row_tile * TILE_ROWS + tl.arange(0, TILE_ROWS)).to(tl.int64)
    b1 = col_tile * TILE_BLOCKS + tl.arange(0, TILE_BLOCKS)
    if NBITS == 4:
        # E2M1: the tile is (blocks, rows, chunks, 8). Triton orders the axes after the
        # contiguous one from the first, so threads go to blocks, then rows, and a block's
        # chunks of 8 elements stay in one thread's registers: the amax needs no shuffles,
        # pairs split in registers, and the packed bytes (4 per chunk) are stored from the
        # load layout (no shared-memory conversion).
        CHUNK: tl.constexpr = 8 if BLOCK >= 8 else BLOCK
        b = b1[:, None, None, None]
        r = r1[None, :, None, None]
        k = tl.arange(0, BLOCK // CHUNK)[None, None, :, None]
        c = b * BLOCK + k * CHUNK + tl.arange(0, CHUNK)[None, None, None, :]
        x = widen(tl.load(x_ptr + r * length + c, mask=(r < rows) & (c < length), other=0), BF16_BITS)
        inv_scale, nonfinite, scale_bytes = block_scales(block_amax(x, 3, 2), RULE, EMAX, MAX_MANT, MBITS)
        code = encode(x * inv_scale[:, :, None, None], MBITS, BIAS, MAX_VALUE, NBITS, NATIVE)
        lo, hi = tl.split(tl.reshape(code, (TILE_BLOCKS, TILE_ROWS, BLOCK // CHUNK, CHUNK // 2, 2)))
        packed = tl.where(nonfinite[:, :, None, None], 0, lo | (hi << 4))  # once per packed byte
        p = b * (BLOCK // 2) + k * (CHUNK // 2) + tl.arange(0, CHUNK // 2)[None, None, None, :]
        tl.store(data_ptr + r * (padded // 2) + p, packed.to(tl.uint8), mask=(r < rows) & (p < padded // 2))
        r2 = r1[None, :]
        b2 = b1[:, None]
    else:
        r = r1[:, None, None]
        b = b1[None, :, None]
        c = b * BLOCK + tl.arange(0, BLOCK)[None, None, :]
        x = widen(tl.load(x_ptr + r * length + c, mask=(r < rows) & (c < length), other=0), BF16_BITS)
        inv_scale, nonfinite, scale_bytes = block_scales(block_amax(x, 2, -1), RULE, EMAX, MAX_MANT, MBITS)
        code = encode(x * inv_scale[:, :, None], MBITS, BIAS, MAX_VALUE, NBITS, NATIVE)
        code = tl.where(nonfinite[:, :, None], 0, code)
        tl.store(data_ptr + r * padded + c, code.to(tl.uint8), mask=(r < rows) & (c < padded))
        r2 = r1[:, None]
        b2 = b1[None, :]
    nblocks = padded // BLOCK
    tl.store(
        scale_ptr + r2 * nblocks + b2,
        scale_bytes.to(tl.uint8),
        mask=(r2 < rows) & (b2 < nblocks),
    )


def group_search_steps(groups: int) -> int:
    """``group_rows``' ``SEARCH_STEPS`` for ``groups`` groups: halvings that reach every
    index 0..groups of the padded starts (2**steps > groups)."""
    return groups.bit_length()


@triton.jit
def group_rows(starts_ptr, padded_starts_ptr, groups, block_row, SEARCH_STEPS: tl.constexpr):
    """(source row offset, row limit) of the padded 32-row blocks starting at ``block_row``:
    padded row p of a block reads input row ``p + offset`` where ``p < limit`` (its group's
    real rows) and is a zero row past it. The group is the last padded start at or before
    the block (empty groups share their start with the next group), found by a binary
    search of ``SEARCH_STEPS`` halvings over the ``groups + 1`` padded starts."""
    g = block_row * 0
    for step in tl.static_range(SEARCH_STEPS):
        probe = g + (1 << (SEARCH_STEPS - 1 - step))
        inside = probe <= groups
        start = tl.load(padded_starts_ptr + probe, mask=inside, other=0)
        g = tl.where(inside & (start <= block_row), probe, g)
    real = g < groups
    padded_start = tl.load(padded_starts_ptr + g)
    start = tl.load(starts_ptr + g)
    size = tl.load(starts_ptr + g + 1, mask=real, other=0) - start
    limit = tl.where(real, padded_start + size, -1)
    return (start - padded_start).to(tl.int64), limit


@triton.jit
def _load_rows(x_ptr, o, row, i, length, inner, shift, limit, GROUPED: tl.constexpr, BF16_BITS: tl.constexpr):
    """Rows ``row`` of ``x[o]`` as fp32; zeros past ``length``, or (``GROUPED``: ``row`` is a
    padded row) past the group's ``limit``, its real rows read at ``row + shift``."""
    if GROUPED:
        src = row.to(tl.int64) + shift
        ok = (row < limit) & (src >= 0) & (src < length) & (i < inner)  # bad device splits: no access
    else:
        src = row.to(tl.int64)
        ok = (row < length) & (i < inner)
    return widen(tl.load(x_ptr + (o * length + src) * inner + i, mask=ok, other=0), BF16_BITS)


@triton.jit
def quantize_strided(
    x_ptr,
    starts_ptr,
    padded_starts_ptr,
    groups,
    data_ptr,
    scale_ptr,
    length,
    padded,
    inner,
    block_tiles,
    inner_tiles,
    SEARCH_STEPS: tl.constexpr,
    BLOCK: tl.constexpr,
    TILE_BLOCKS: tl.constexpr,
    TILE_INNER: tl.constexpr,
    ROW_THREADS: tl.constexpr,
    RULE: tl.constexpr,
    EMAX: tl.constexpr,
    MAX_MANT: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_VALUE: tl.constexpr,
    NBITS: tl.constexpr,
    BF16_BITS: tl.constexpr,
    NATIVE: tl.constexpr,
):
    pid = tl.program_id(0)
    per_outer = block_tiles * inner_tiles
    o = (pid // per_outer).to(tl.int64)
    rest = pid % per_outer
    b1 = (rest // inner_tiles) * TILE_BLOCKS + tl.arange(0, TILE_BLOCKS)
    i1 = (rest % inner_tiles) * TILE_INNER + tl.arange(0, TILE_INNER)
    # A tile is (rows in registers, blocks, rows across threads, inner). Triton gives each
    # thread 16 contiguous inner elements (the byte stores' width; the loads match them),
    # fills a warp with inner columns and then ROW_THREADS rows, and puts the warps on the
    # blocks axis: the amax is a register max plus log2(ROW_THREADS) shuffles, never a
    # trip through shared memory, and the codes are stored from the load layout.
    # For E2M1, rows 2m and 2m + 1 are loaded as two such tiles, so pairs pack in place.
    PER: tl.constexpr = 2 if NBITS == 4 else 1
    ROW_REGS: tl.constexpr = BLOCK // PER // ROW_THREADS
    i = i1[None, None, None, :]
    m = tl.arange(0, ROW_THREADS)[:, None, None, None] * ROW_REGS + tl.arange(0, ROW_REGS)[None, None, :, None]
    j = b1[None, :, None, None] * BLOCK + m * PER
    GROUPED: tl.constexpr = SEARCH_STEPS > 0
    if GROUPED:
        shift, limit = group_rows(starts_ptr, padded_starts_ptr, groups, b1 * BLOCK, SEARCH_STEPS)
        shift = shift[None, :, None, None]
        limit = limit[None, :, None, None]
    else:
        shift, limit = 0, 0
    x0 = _load_rows(x_ptr, o, j, i, length, inner, shift, limit, GROUPED, BF16_BITS)
    amax = block_amax(x0, 2, -1)  # registers first, then one shuffle tree for both halves
    if NBITS == 4:
        x1 = _load_rows(x_ptr, o, j + 1, i, length, inner, shift, limit, GROUPED, BF16_BITS)
        amax = tl.maximum(amax, block_amax(x1, 2, -1))
    inv_scale, nonfinite, scale_bytes = block_scales(tl.max(amax, axis=0), RULE, EMAX, MAX_MANT, MBITS)
    inv_scale = inv_scale[None, :, None, :]
    code = encode(x0 * inv_scale, MBITS, BIAS, MAX_VALUE, NBITS, NATIVE)
    if NBITS == 4:
        code = code | (encode(x1 * inv_scale, MBITS, BIAS, MAX_VALUE, NBITS, NATIVE) << 4)
    code = tl.where(nonfinite[None, :, None, :], 0, code)  # once per packed byte
    nblocks = padded // BLOCK
    b2 = b1[:, None]
    i2 = i1[None, :]
    tl.store(
        scale_ptr + (o * nblocks + b2) * inner + i2,
        scale_bytes.to(tl.uint8),
        mask=(b2 < nblocks) & (i2 < inner),
    )
    out_row = j // PER
    ok = (out_row < padded // PER) & (i < inner)
    tl.store(data_ptr + (o * (padded // PER) + out_row) * inner + i, code.to(tl.uint8), mask=ok)
