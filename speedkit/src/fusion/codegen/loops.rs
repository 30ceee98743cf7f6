//! The bodies of generated kernels: a pointwise kernel's loop over elements, a row reduction's
//! over rows (a group norm's two statistics, its backward's channels, the sums over columns and
//! the entry point that adds them up), and a row held in registers between its passes.

use std::fmt::Write;

use super::norms::{channel_read, GradientRows, GroupNormGradients};
use super::{RowReduction, StoredResult, UNROLL};

/// The body of a pointwise kernel. `vectorised`: each thread computes `width` (four, or eight of
/// 16-bit types) neighbouring elements of every result, whose inputs `LOAD` reads `width` at a
/// time, and stores each result's at once. Else a block takes tiles of `UNROLL` × its threads elements, a thread's a block apart
/// (as ATen's unrolled kernels). Either way every value comes first, then the stores: a load after
/// a store through another pointer could not be shared, as the compiler cannot rule out aliasing.
pub(super) fn pointwise_loop(
    stored: &[StoredResult],
    vectorised: bool,
    groups: &[usize],
    width: u64,
) -> String {
    let (mut declare, mut values, mut stores) = (String::new(), String::new(), String::new());
    let (load, store) = match width {
        8 => ("load_group8", "store8"),
        _ => ("load_group", "store4"),
    };
    if vectorised {
        writeln!(declare, "    a.first = q * {width};").unwrap();
        for i in groups {
            writeln!(declare, "    a.g{i} = {load}(a.in{i} + a.first);").unwrap();
        }
    }
    for r in stored {
        let (i, f, ty) = (r.arg, r.function, r.ty);
        writeln!(declare, "    float r{i}[{width}];").unwrap();
        if vectorised {
            writeln!(values, "      r{i}[k] = v{f}(a, p, red);").unwrap();
            writeln!(stores, "    {store}(a.out{i} + a.first, r{i});").unwrap();
        } else {
            writeln!(values, "      if (p < (idx_t)n) r{i}[k] = v{f}(a, p, red);").unwrap();
            writeln!(
                stores,
                "      if (p < (idx_t)n) a.out{i}[p] = store_as<{ty}>(r{i}[k]);"
            )
            .unwrap();
        }
    }
    let each = |p: &str, count: u64| {
        format!("#pragma unroll\n    for (int k = 0; k < {count}; ++k) {{\n      const idx_t p = {p};\n")
    };
    if vectorised {
        return format!(
            "  const float2 red = NO_ROW;
  for (idx_t q = blockIdx.x * (idx_t)blockDim.x + threadIdx.x; q < (idx_t)(n / {width}); q += (idx_t)gridDim.x * blockDim.x) {{
{declare}{}{values}    }}
{stores}  }}
",
            each("a.first + k", width)
        );
    }
    let each = each("tile + k * (idx_t)blockDim.x", UNROLL);
    format!(
        "  const float2 red = NO_ROW;
  for (idx_t tile = blockIdx.x * (idx_t)blockDim.x * {UNROLL} + threadIdx.x; tile < (idx_t)n; tile += (idx_t)gridDim.x * blockDim.x * {UNROLL}) {{
{declare}{each}{values}    }}
{each}{stores}    }}
  }}
"
    )
}

/// The body of a kernel with a row reduction: a block per row (`n` rows) reduces the row (unless
/// its rows are kept for their sums over columns alone), then writes the results of the whole space
/// (one per column) and of the rows (one per row), summing the columns as it goes. Vectorised, a
/// thread takes four neighbouring columns at a time, as [`pointwise_loop`] takes elements.
pub(super) fn row_loop(
    r: &RowReduction,
    stored: &[StoredResult],
    vectorised: bool,
    groups: &[usize],
    cache: Option<RowCache>,
    strips: Option<ColumnStrips>,
) -> String {
    if let Some(strips) = strips {
        return column_strips_loop(r, stored, groups, strips);
    }
    let (init, combine, warp) = match r.op {
        "amax" => ("-infinity()", "fmaxf(acc, v)", "warp_max"),
        _ => ("0.f", "acc + v", "warp_sum"),
    };
    let finish = if r.op == "mean" {
        format!("partial[0] / {}.f", r.width)
    } else {
        "partial[0]".to_string()
    };
    let columns = column_loop(r.width, vectorised, groups);
    let mut accumulate = String::new();
    // A row taken whole keeps each slot's sums apart: a slot's channel is its own.
    let slot = match cache.is_some_and(|c| c.chunks.is_some()) {
        true => "[j]",
        false => "",
    };
    for (t, value) in (r.gradients.iter()).flat_map(|g| g.channel_sums.iter().enumerate()) {
        writeln!(accumulate, "        t{t}{slot} += {value};").unwrap();
    }
    for (t, value) in r.column_sums.iter().enumerate() {
        let slot = column_slot(r.width, vectorised, &format!("p - row * {}", r.width));
        writeln!(accumulate, "        cols{t}[{slot}] += {value};").unwrap();
    }
    let own = cache.map(|c| c.own());
    let (whole, per_row) = row_stores(stored, r.width, vectorised, own, &accumulate);
    if let Some(gradients) = &r.gradients {
        let rows = match cache {
            Some(
                cache @ RowCache {
                    chunks: Some(chunks),
                    ..
                },
            ) => cache.whole_gradient_rows(chunks, gradients, groups, &whole),
            Some(cache) => group_norm_backward_loop(
                gradients,
                &cache.gradient_loops(gradients, groups, &whole),
            ),
            None => group_norm_backward_loop(
                gradients,
                &uncached_gradient_loops(gradients, vectorised, groups, &whole),
            ),
        };
        return rows + &channel_totals(gradients, stored);
    }
    if r.op == "layer_norm_backward" {
        let loads = match layer_norm_backward_threads(r, vectorised) {
            Some(_) => RowLoads::Once(groups),
            None => RowLoads::EachPass(&columns),
        };
        return layer_norm_backward_loop(r, loads, vectorised, &whole, &per_row);
    }
    if r.op == "moments" {
        return match cache {
            Some(cache) => cache.moments_loop(r, groups, &whole, &per_row),
            None => moments_loop(r, &columns, vectorised, &whole, &per_row),
        };
    }
    let read = if vectorised {
        format!("#pragma unroll\n      for (int k = 0; k < {UNROLL}; ++k) {{\n        const float v = in_red(a, row, col + k, NO_ROW);\n        acc = {combine};\n      }}\n")
    } else {
        format!("      const float v = in_red(a, row, col, NO_ROW);\n      acc = {combine};\n")
    };
    let reduce = format!(
        "    float acc = {init};
    {columns}{read}    }}
    acc = {warp}(acc);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x < 32) {{
      acc = threadIdx.x < (blockDim.x + 31) / 32 ? partial[threadIdx.x] : {init};
      acc = {warp}(acc);
      if (threadIdx.x == 0) partial[0] = acc;
    }}
    __syncthreads();
    const float2 red = make_float2({finish}, 0.f);
"
    );
    // Rows kept only for their sums over columns reduce nothing of their own.
    let reduce = match r.op {
        "columns" => "    const float2 red = NO_ROW;\n".to_string(),
        _ => reduce,
    };
    let (open, close) = column_sums(r, vectorised);
    format!(
        "  __shared__ float partial[32];
{open}  for (idx_t row = blockIdx.x; row < (idx_t)n; row += gridDim.x) {{
{reduce}    {columns}{whole}    }}
{tail}{close}",
        tail = row_tail(&per_row),
    )
}

/// The threads of a block of a kernel whose rows are kept for their sums over columns alone
/// ([`ColumnStrips`]): eight warps, each on its own row.
pub(super) const COLUMN_THREADS: u64 = 256;

/// The warps of such a block.
const STRIP_WARPS: u64 = COLUMN_THREADS / 32;

/// The most floats a thread of such a kernel adds its columns' sums up in, as registers.
const COLUMN_REGISTERS: u64 = 32;

/// About as many blocks as such a kernel runs: enough to keep an H100's or H200's SMs busy.
const STRIP_BLOCKS: u64 = 1024;

/// The grid of a vectorised kernel whose rows are kept for their sums over columns alone (no row
/// reduction of their own), as speedkit's bias-gradient kernel runs (`kernels/bias_grad.cuh`): a
/// block per tile of 32 × `vector` columns and strip of rows, each of its warps on every eighth
/// row of the strip, each lane adding its `vector` columns up in registers. The block's warps add
/// theirs in order, and the block keeps one sum a column for the finish ([`column_finish`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct ColumnStrips {
    /// Columns each lane takes (a vector load of each input).
    pub(super) vector: u64,
    /// Tiles of 32 × `vector` columns.
    tiles: u64,
    /// Strips of rows.
    pub(super) strips: u64,
}

impl ColumnStrips {
    /// The grid of `r`'s kernel taking `vector` columns a lane, where its rows are summed over
    /// columns alone, every sum fits in [`COLUMN_REGISTERS`] registers and each block has rows.
    pub(super) fn of(r: &RowReduction, vectorised: bool, vector: u64) -> Option<ColumnStrips> {
        let tiles = r.width.div_ceil(32 * vector);
        let strips = (STRIP_BLOCKS / tiles)
            .min(r.rows.div_ceil(STRIP_WARPS))
            .min(r.rows / tiles.max(1));
        let fits = vector * r.column_sums.len() as u64 <= COLUMN_REGISTERS;
        let columns = r.op == "columns" && vectorised && r.width % vector == 0;
        (columns && fits && strips >= 1).then_some(ColumnStrips {
            vector,
            tiles,
            strips,
        })
    }

    /// The kernel's blocks (at most its rows: the launch runs a block a row at most).
    pub(super) fn blocks(&self) -> u64 {
        self.tiles * self.strips
    }
}

/// The body of a kernel whose rows are kept for their sums over columns alone ([`ColumnStrips`]).
/// A sum in shared memory, block per row, took a store to shared memory per element and the
/// sums of 1024 blocks: the row kernel of GPT-2 small's GELU backward with its bias's gradient
/// (3072 columns) took 52.5 µs and a 12 µs finish for 144 MiB on an H200, where ATen's GELU
/// backward and speedkit's bias gradient took 41.8 and 12.5.
fn column_strips_loop(
    r: &RowReduction,
    stored: &[StoredResult],
    groups: &[usize],
    strips: ColumnStrips,
) -> String {
    let (width, rows) = (r.width, r.rows);
    let ColumnStrips {
        vector,
        tiles,
        strips,
    } = strips;
    let (load, store) = match vector {
        8 => ("load_group8", "store8"),
        _ => ("load_group", "store4"),
    };
    let (mut declare, mut values, mut stores) = (String::new(), String::new(), String::new());
    let (mut accumulate, mut keep) = (String::new(), String::new());
    for (t, value) in r.column_sums.iter().enumerate() {
        writeln!(declare, "  float cs{t}[{vector}] = {{}};").unwrap();
        writeln!(accumulate, "        cs{t}[k] += {value};").unwrap();
        write!(
            keep,
            "  #pragma unroll
  for (int k = 0; k < {vector}; ++k) sums[warp][lane * {vector} + k] = cs{t}[k];
  __syncthreads();
  if (warp == 0 && col < {width}) {{
#pragma unroll
    for (int k = 0; k < {vector}; ++k) {{
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < {STRIP_WARPS}; ++w) total += sums[w][lane * {vector} + k];
      ws[({t} * (idx_t){strips} + strip) * {width} + col + k] = total;
    }}
  }}
  __syncthreads();
"
        )
        .unwrap();
    }
    for s in stored.iter().filter(|s| s.channel.is_none() && !s.per_row) {
        let (i, f) = (s.arg, s.function);
        writeln!(values, "      float r{i}[{vector}];").unwrap();
        writeln!(accumulate, "        r{i}[k] = v{f}(a, p, red);").unwrap();
        writeln!(stores, "      {store}(a.out{i} + a.first, r{i});").unwrap();
    }
    let mut loads = String::new();
    for i in groups {
        writeln!(loads, "      a.g{i} = {load}(a.in{i} + a.first);").unwrap();
    }
    let zero = FinishPlan::of(r, strips).zero_counters();
    format!(
        "  __shared__ float sums[{STRIP_WARPS}][{}];
{declare}{zero}  const float2 red = NO_ROW;
  const idx_t tile = blockIdx.x % {tiles}, strip = blockIdx.x / {tiles};
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const idx_t col = (tile * 32 + lane) * {vector};
  if (col < {width}) {{
    for (idx_t row = strip * {STRIP_WARPS} + warp; row < {rows}; row += {strips} * {STRIP_WARPS}) {{
      a.first = row * {width} + col;
{loads}{values}#pragma unroll
      for (int k = 0; k < {vector}; ++k) {{
        const idx_t p = a.first + k;
{accumulate}      }}
{stores}    }}
  }}
{keep}",
        32 * vector
    )
}

/// The threads of a layer norm's backward's block where each holds its four columns of the row
/// across both passes ([`RowLoads::Once`]): a vectorised row of at most 1024 × four columns, a
/// thread per four, in whole warps. `None` for other rows (256 threads, loading each pass).
pub(super) fn layer_norm_backward_threads(r: &RowReduction, vectorised: bool) -> Option<u64> {
    let threads = r.width.div_ceil(UNROLL).next_multiple_of(32);
    (r.op == "layer_norm_backward" && vectorised && threads <= 1024).then_some(threads)
}

/// How a row kernel's two passes over a row get its inputs.
enum RowLoads<'a> {
    /// Each pass loads them in its loop over the columns (this head).
    EachPass(&'a str),
    /// Each thread loads its four columns of these inputs once, before the first pass: the
    /// second reads them from registers instead of the cache, and the inputs only the second
    /// pass reads (an accumulated gradient) are on their way during the row's sums.
    Once(&'a [usize]),
}

/// The body of a layer norm's backward's kernel ([`Generator::layer_norm_backward`]): a block per
/// row sums the row's two terms (`ln_terms`: `dy * w` and `dy * w * xhat`), hands their means to
/// every function as `red`, then writes the row's results and sums its columns.
fn layer_norm_backward_loop(
    r: &RowReduction,
    loads: RowLoads<'_>,
    vectorised: bool,
    whole: &str,
    per_row: &str,
) -> String {
    let add = "acc.x += t.x;\n        acc.y += t.y;";
    let read = if vectorised {
        format!("#pragma unroll\n      for (int k = 0; k < {UNROLL}; ++k) {{\n        const float2 t = ln_terms(a, row, col + k);\n        {add}\n      }}\n")
    } else {
        format!("      const float2 t = ln_terms(a, row, col);\n      {add}\n")
    };
    let width = r.width;
    let (first, second) = match loads {
        RowLoads::EachPass(columns) => (columns.to_string(), columns.to_string()),
        RowLoads::Once(groups) => {
            let mut first = format!("const idx_t col = threadIdx.x * {UNROLL};\n    const bool mine = col < {width};\n    if (mine) {{\n      a.first = row * {width} + col;\n");
            for i in groups {
                writeln!(first, "      a.g{i} = load_group(a.in{i} + a.first);").unwrap();
            }
            (first, "if (mine) {\n".to_string())
        }
    };
    let (open, close) = column_sums(r, vectorised);
    format!(
        "  __shared__ float2 partial[32];
{open}  for (idx_t row = blockIdx.x; row < (idx_t)n; row += gridDim.x) {{
    float2 acc = make_float2(0.f, 0.f);
    {first}{read}    }}
    const float2 sums = block_sum2(acc, partial);
    const float2 red = make_float2(sums.x / {width}.f, sums.y / {width}.f);
    {second}{whole}    }}
{tail}{close}",
        tail = row_tail(per_row),
    )
}

/// The code around a row kernel's loop that sums its columns ([`RowReduction::column_sums`]):
/// before, each sum's columns zeroed in shared memory (each thread adds to its own columns as it
/// writes its elements); after, each block's sums kept in the workspace `ws`, for the kernel's
/// second entry point ([`column_finish`]) to add up.
fn column_sums(r: &RowReduction, vectorised: bool) -> (String, String) {
    if r.column_sums.is_empty() {
        return (String::new(), String::new());
    }
    let width = r.width;
    let slot = column_slot(width, vectorised, "c");
    let (mut open, mut keep) = (String::new(), String::new());
    for t in 0..r.column_sums.len() {
        writeln!(open, "  __shared__ float cols{t}[{width}];").unwrap();
        writeln!(
            open,
            "  for (idx_t c = threadIdx.x; c < {width}; c += blockDim.x) cols{t}[c] = 0.f;"
        )
        .unwrap();
        writeln!(
            keep,
            "    ws[({t} * (idx_t)gridDim.x + blockIdx.x) * {width} + c] = cols{t}[{slot}];"
        )
        .unwrap();
    }
    open.push_str(&FinishPlan::of(r, super::column_blocks(r, vectorised)).zero_counters());
    open.push_str("  __syncthreads();\n");
    let close =
        format!("  for (idx_t c = threadIdx.x; c < {width}; c += blockDim.x) {{\n{keep}  }}\n");
    (open, close)
}

/// Where column `c` (C code) of a row of `width` keeps its sum in shared memory. A vectorised
/// thread adds to four neighbouring columns, one after the other: stored as they are, a warp's
/// 32 threads would add to every fourth float (banks four ways in conflict), so the columns are
/// kept by their place in their group of four, then by their group.
fn column_slot(width: u64, vectorised: bool, c: &str) -> String {
    match vectorised {
        true => format!("(({c}) & 3) * {} + (({c}) >> 2)", width / UNROLL),
        false => c.to_string(),
    }
}

/// The threads a block of [`column_finish`] runs: [`FINISH_LANES`] warps, a column a lane.
pub(super) const FINISH_THREADS: u64 = 32 * FINISH_LANES;

/// The warps of a block of [`column_finish`], each summing every [`FINISH_LANES`]th block's sums
/// of its slice.
const FINISH_LANES: u64 = 8;

/// About as many blocks as [`column_finish`] runs: two an SM of an H100 or H200. A row of 768
/// columns has 24 blocks of 32 columns: summed whole by each, the finish of a layer norm's
/// backward (three sums of 1024 blocks, 9 MiB) took 8.7–9.9 µs on an H200, its loads too few.
const FINISH_BLOCKS: u64 = 264;

/// How a row kernel's blocks' sums over columns are added up ([`column_finish`]): a block per 32
/// columns and per slice of the row kernel's blocks; with more than one slice, each keeps its
/// slice's sums in the workspace after the blocks' and counts itself done, and the last of a
/// column's slices adds them up in slice order, so every run gives the same values.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct FinishPlan {
    /// The row kernel's blocks (each keeps its sums of every column).
    blocks: u64,
    /// Columns in tiles of 32.
    tiles: u64,
    /// Slices of the blocks, each summed by a block of the finish.
    slices: u64,
    /// Sums over columns, and the row's width.
    sums: u64,
    width: u64,
}

impl FinishPlan {
    /// The plan for `r`'s sums over columns, its kernel running `blocks` blocks.
    pub(super) fn of(r: &RowReduction, blocks: u64) -> FinishPlan {
        let tiles = r.width.div_ceil(32);
        FinishPlan {
            blocks,
            tiles,
            slices: (FINISH_BLOCKS / tiles).clamp(1, blocks.div_ceil(FINISH_LANES)),
            sums: r.column_sums.len() as u64,
            width: r.width,
        }
    }

    /// The finish's blocks.
    pub(super) fn finish_blocks(&self) -> u64 {
        self.tiles * self.slices
    }

    /// Floats of workspace: every block's sums, then (sliced) every slice's and a counter a tile.
    pub(super) fn workspace(&self) -> u64 {
        self.slice_sums_at() + self.slice_floats() + self.counters()
    }

    fn slice_sums_at(&self) -> u64 {
        self.sums * self.blocks * self.width
    }

    fn slice_floats(&self) -> u64 {
        match self.slices {
            1 => 0,
            _ => self.sums * self.slices * self.width,
        }
    }

    fn counters(&self) -> u64 {
        match self.slices {
            1 => 0,
            _ => self.tiles,
        }
    }

    /// The row kernel's code zeroing the tiles' counters before the finish runs (its first
    /// block's, at the start: the finish launches after the whole kernel, on the same stream).
    pub(super) fn zero_counters(&self) -> String {
        match self.counters() {
            0 => String::new(),
            tiles => format!(
                "  if (blockIdx.x == 0)\n    for (idx_t c = threadIdx.x; c < {tiles}; c += blockDim.x) reinterpret_cast<unsigned*>(ws + {})[c] = 0u;\n",
                self.slice_sums_at() + self.slice_floats()
            ),
        }
    }
}

/// The body of a row kernel's second entry point, launched after it with the same arguments
/// ([`FinishPlan`]): a block per 32 columns and slice of blocks adds up its slice's sums of each
/// column ([`column_sums`]), each warp every [`FINISH_LANES`]th block's, then the warps' in
/// order; with one slice it writes the results, else the last slice of a tile adds the slices'.
pub(super) fn column_finish(plan: &FinishPlan, stored: &[StoredResult]) -> String {
    let FinishPlan {
        blocks,
        tiles,
        slices,
        width,
        ..
    } = *plan;
    let per = blocks.div_ceil(slices);
    let mut body = format!(
        "  __shared__ float lanes[{FINISH_LANES}][32];
  const idx_t tile = blockIdx.x % {tiles}, slice = blockIdx.x / {tiles};
  const idx_t c = tile * (idx_t)32 + (threadIdx.x & 31);
  const int lane = threadIdx.x >> 5;
  const idx_t first = slice * {per}, end = min((idx_t){blocks}, first + {per});
"
    );
    let mut last = String::new();
    for s in stored {
        let Some(t) = s.channel else { continue };
        let keep = match slices {
            1 => format!("a.out{}[c] = store_as<{}>(total)", s.arg, s.ty),
            _ => format!(
                "ws[{} + ({t} * (idx_t){slices} + slice) * {width} + c] = total",
                plan.slice_sums_at()
            ),
        };
        write!(
            body,
            "  {{
    float sum = 0.f;
    if (c < {width})
#pragma unroll 4
      for (idx_t b = first + lane; b < end; b += {FINISH_LANES}) sum += ws[({t} * (idx_t){blocks} + b) * {width} + c];
    lanes[lane][threadIdx.x & 31] = sum;
    __syncthreads();
    if (lane == 0 && c < {width}) {{
      float total = 0.f;
#pragma unroll
      for (int l = 0; l < {FINISH_LANES}; ++l) total += lanes[l][threadIdx.x & 31];
      {keep};
    }}
    __syncthreads();
  }}
"
        )
        .unwrap();
        write!(
            last,
            "    if (lane == 0 && c < {width}) {{
      float total = 0.f;
      for (idx_t q = 0; q < {slices}; ++q) total += __ldcg(ws + {} + ({t} * (idx_t){slices} + q) * {width} + c);
      a.out{}[c] = store_as<{}>(total);
    }}
",
            plan.slice_sums_at(),
            s.arg,
            s.ty
        )
        .unwrap();
    }
    if slices > 1 {
        let counters = plan.slice_sums_at() + plan.slice_floats();
        write!(
            body,
            "  __shared__ bool last;
  __threadfence();
  if (threadIdx.x == 0)
    last = atomicAdd(reinterpret_cast<unsigned*>(ws + {counters}) + tile, 1u) == {slices} - 1;
  __syncthreads();
  if (last) {{
    __threadfence();
{last}    if (threadIdx.x == 0) reinterpret_cast<unsigned*>(ws + {counters})[tile] = 0u;
  }}
"
        )
        .unwrap();
    }
    body
}

/// The end of a row's loop: the row's one thread writes the results of one value a row
/// (`per_row`), then the block waits for every thread before it takes its next row.
fn row_tail(per_row: &str) -> String {
    format!(
        "    if (threadIdx.x == 0) {{
      const idx_t p = row;
{per_row}    }}
    __syncthreads();
  }}
"
    )
}

/// The body of a group norm's kernel: a block per row sums the row for its mean, then the squares
/// of its elements less the mean for its variance (two passes: a row's second read comes from the
/// cache, and the variance is as exact as ATen's Welford one), then writes the results.
fn moments_loop(
    r: &RowReduction,
    columns: &str,
    vectorised: bool,
    whole: &str,
    per_row: &str,
) -> String {
    let width = r.width;
    let read = |value: &str| {
        if vectorised {
            format!("#pragma unroll\n      for (int k = 0; k < {UNROLL}; ++k) {{\n        const float v = in_red(a, row, col + k, NO_ROW);\n        acc += {value};\n      }}\n")
        } else {
            format!("      const float v = in_red(a, row, col, NO_ROW);\n      acc += {value};\n")
        }
    };
    let (sum, squares) = (read("v"), read("(v - mean) * (v - mean)"));
    format!(
        "  __shared__ float partial[32];
  for (idx_t row = blockIdx.x; row < (idx_t)n; row += gridDim.x) {{
    float acc = 0.f;
    {columns}{sum}    }}
    const float mean = block_sum(acc, partial) / {width}.f;
    acc = 0.f;
    {columns}{squares}    }}
    const float variance = block_sum(acc, partial) / {width}.f;
    const float2 red = make_float2(mean, rsqrtf(fmaxf(variance, 0.f) + {eps:?}f));
    {columns}{whole}    }}
{tail}",
        eps = r.eps as f32,
        tail = row_tail(per_row),
    )
}

/// A group norm's backward's two loops over channel `cl` of a row: the one summing it (`s += dy *
/// x`, `b += dy`), and the one writing the input's gradient (and adding to the channel sums).
struct GradientLoops {
    /// What a row declares first.
    declare: String,
    /// `#pragma unroll` where the loops over the channels are unrolled (a row held in registers).
    unroll: &'static str,
    /// The loop over the channel's elements summing them, opened and closed.
    sums: String,
    /// The loop over the channel's elements writing the results, opened and closed.
    stores: String,
}

/// [`GradientLoops`] reading each element where it is needed.
fn uncached_gradient_loops(
    gradients: &GradientRows,
    vectorised: bool,
    groups: &[usize],
    whole: &str,
) -> GradientLoops {
    let (hxw, width) = (gradients.shape.hxw, gradients.shape.width());
    let mut head = match vectorised {
        true => format!("for (idx_t hw = threadIdx.x * {UNROLL}; hw < {hxw}; hw += blockDim.x * {UNROLL}) {{\n        const idx_t col = cl * {hxw} + hw;\n        a.first = row * {width} + col;\n"),
        false => format!("for (idx_t hw = threadIdx.x; hw < {hxw}; hw += blockDim.x) {{\n        const idx_t col = cl * {hxw} + hw;\n"),
    };
    for i in groups.iter().filter(|_| vectorised) {
        writeln!(head, "        a.g{i} = load_group(a.in{i} + a.first);").unwrap();
    }
    let sums = if vectorised {
        format!("{head}#pragma unroll\n        for (int k = 0; k < {UNROLL}; ++k) {{\n          const float dy = in_dy(a, row, col + k, NO_ROW);\n          s += dy * in_x(a, row, col + k, NO_ROW);\n          b += dy;\n        }}\n      }}\n")
    } else {
        format!("{head}        const float dy = in_dy(a, row, col, NO_ROW);\n        s += dy * in_x(a, row, col, NO_ROW);\n        b += dy;\n      }}\n")
    };
    GradientLoops {
        declare: String::new(),
        unroll: "",
        sums,
        stores: format!("{head}{whole}      }}\n"),
    }
}

/// The lines every group norm backward's row takes, however it walks the row.
struct GradientRowText {
    /// The row's statistics and sample, first.
    statistics: String,
    /// `channel`, the index of the row's channel `cl`.
    channel: String,
    /// Channel `channel`'s terms of the weight and bias gradients (of its sums `s` of `dy * x`
    /// and `b` of `dy`), kept in the workspace for the last block.
    terms: String,
    /// The row's coefficients (`red`) of the input gradient, from the weighted sums.
    coefficients: &'static str,
}

impl GradientRowText {
    fn of(gradients: &GradientRows) -> GradientRowText {
        let GroupNormGradients {
            samples,
            channels,
            groups,
            ..
        } = gradients.shape;
        let per_group = gradients.shape.channels_per_group();
        let (mean, rstd, bias_terms) = (gradients.mean, gradients.rstd, samples * channels);
        GradientRowText {
            statistics: format!("    const float mean = to_float_any(a.in{mean}[row]);\n    const float rstd = to_float_any(a.in{rstd}[row]);\n    const idx_t sample = row / {groups};\n"),
            channel: format!("const idx_t channel = (row % {groups}) * {per_group} + cl;"),
            terms: format!("ws[1 + sample * {channels} + channel] = (s - b * mean) * rstd;\n        ws[1 + {bias_terms} + sample * {channels} + channel] = b;"),
            coefficients: "    const float cx = (sum_dy * mean - sum_dy_x) * rstd * rstd * rstd * s_width;\n    const float2 red = make_float2(cx, -cx * mean - sum_dy * rstd * s_width);\n",
        }
    }
}

/// The rows of a group norm's backward's kernel ([`Generator::group_norm_backward`]), channel by
/// channel. A block per row sums `dy * x` and `dy` over each of the row's channels, one channel
/// after the other, and keeps each sample's channel terms of the weight and bias gradients in the
/// workspace `ws` (after its first float, a counter of finished blocks); then writes the row's
/// input gradient, channel after channel, keeping each channel's sums
/// ([`Generator::channel_sum`]) there too. [`channel_totals`] follows.
fn group_norm_backward_loop(gradients: &GradientRows, loops: &GradientLoops) -> String {
    let GroupNormGradients {
        samples, channels, ..
    } = gradients.shape;
    let (width, per_group) = (
        gradients.shape.width(),
        gradients.shape.channels_per_group(),
    );
    let w = channel_read(gradients.weight, "channel", "1.f");
    let bias_terms = samples * channels;
    let GradientRowText {
        statistics,
        channel,
        terms,
        coefficients,
    } = GradientRowText::of(gradients);
    let GradientLoops {
        declare,
        unroll,
        sums,
        stores,
    } = loops;
    // Per channel: its sums' terms of this sample, kept in the workspace after the weight's and
    // the bias's.
    let (mut open, mut close) = (String::new(), String::new());
    for t in 0..gradients.channel_sums.len() as u64 {
        writeln!(open, "      float t{t} = 0.f;").unwrap();
        writeln!(close, "      t{t} = block_sum(t{t}, partial);\n      if (threadIdx.x == 0) ws[1 + {} + sample * {channels} + channel] = t{t};", (2 + t) * bias_terms).unwrap();
    }
    format!(
        "  __shared__ float partial[32];
  const float s_width = 1.f / {width}.f;
  for (idx_t row = blockIdx.x; row < (idx_t)n; row += gridDim.x) {{
{statistics}    float sum_dy_x = 0.f, sum_dy = 0.f;
{declare}{unroll}
    for (int cl = 0; cl < {per_group}; ++cl) {{
      {channel}
      float s = 0.f, b = 0.f;
      {sums}      s = block_sum(s, partial);
      b = block_sum(b, partial);
      const float w = {w};
      sum_dy_x += s * w;
      sum_dy += b * w;
      if (threadIdx.x == 0) {{
        {terms}
      }}
    }}
{coefficients}{unroll}
    for (int cl = 0; cl < {per_group}; ++cl) {{
      {channel}
{open}      {stores}{close}    }}
    __syncthreads();
  }}
"
    )
}

/// The end of a group norm's backward's kernel, after its rows: the last block to finish sums
/// the workspace's terms of each channel over the samples, in order (the same sums every run),
/// into the weight's and bias's gradients and each sum over channels.
fn channel_totals(gradients: &GradientRows, stored: &[StoredResult]) -> String {
    let GroupNormGradients {
        samples, channels, ..
    } = gradients.shape;
    let bias_terms = samples * channels;
    let mut finish = String::new();
    for t in 0..gradients.channel_sums.len() as u64 {
        writeln!(finish, "      float sum{} = 0.f;\n      for (idx_t sample = 0; sample < {samples}; ++sample) sum{} += __ldcg(ws + 1 + {} + sample * {channels} + channel);", 2 + t, 2 + t, (2 + t) * bias_terms).unwrap();
    }
    for r in stored {
        if let Some(which) = r.channel {
            let sum = match which {
                0 => "weight_sum".to_string(),
                1 => "bias_sum".to_string(),
                k => format!("sum{k}"),
            };
            writeln!(
                finish,
                "      a.out{}[channel] = store_as<{}>({sum});",
                r.arg, r.ty
            )
            .unwrap();
        }
    }
    format!(
        "  // The last block to finish: every other block's terms are written (each fenced before it
  // counted itself), and are read past the L1 cache.
  __shared__ bool last_block;
  if (threadIdx.x == 0) {{
    __threadfence();
    last_block = atomicAdd(reinterpret_cast<unsigned int*>(ws), 1u) == gridDim.x - 1;
  }}
  __syncthreads();
  if (last_block) {{
    __threadfence();
    for (idx_t channel = threadIdx.x; channel < {channels}; channel += blockDim.x) {{
      float weight_sum = 0.f, bias_sum = 0.f;
#pragma unroll 8
      for (idx_t sample = 0; sample < {samples}; ++sample) {{
        weight_sum += __ldcg(ws + 1 + sample * {channels} + channel);
        bias_sum += __ldcg(ws + 1 + {bias_terms} + sample * {channels} + channel);
      }}
{finish}    }}
  }}
"
    )
}

/// A row held in registers between its passes: each of `threads` threads a block holds `slots`
/// groups of four of the row's elements (of a group norm's backward, `slots` per channel of its
/// group, or of the whole row, [`Chunks`]), so that a row's input is computed once, not once per
/// pass. A row kernel's input is often a chain (a concatenation, a cast, a bias added; SiLU's
/// backward of the recomputed norm) whose index arithmetic and transcendental functions cost more
/// than the memory it reads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct RowCache {
    pub(super) threads: u64,
    slots: u64,
    /// Where a group norm's backward takes its row whole rather than channel by channel.
    chunks: Option<Chunks>,
    /// A warp a row ([`WARP_ROWS`] a block), where a norm's row fits a warp's registers.
    pub(super) warp_rows: bool,
}

/// The rows a block of a warp-a-row kernel takes ([`RowCache::warp_rows`]): a warp each. A block
/// a row left a quarter of its 256 threads idle on a 768-wide layer norm and met at two block
/// sums per row; a warp sums its row in registers (the forward of `transformer_tch`'s layer norm,
/// 16384 rows: 46.1 µs a call, 41.6 with a warp a row, on an H200).
pub(super) const WARP_ROWS: u64 = 8;

/// A group norm's backward's row taken whole: slot `j` of thread `t` is the row's elements from
/// `(j * threads + t) * 4`, whatever their channel, and the row's channel sums are added up in
/// `count` chunks of `elements` elements each, all of one channel: a warp's slot where channels
/// are of 128 elements or more, else a channel's lanes. Channel by channel, a block of 256 threads
/// left three in four idle on 16 × 16 maps, and summed every channel with its own two block sums.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Chunks {
    elements: u64,
    count: u64,
}

/// The most values a thread holds: 32 registers of the 64 a thread of a block of 1024 has.
const CACHED_VALUES: u64 = 32;

/// The most chunks a row taken whole is summed in ([`Chunks`]): their sums live in shared memory.
const MAX_CHUNKS: u64 = 1024;

impl RowCache {
    /// The cache of a vectorised group norm's kernel, or of its backward's: the fewest threads
    /// (256 to 1024) that hold the row in [`CACHED_VALUES`] a thread; `None` for a longer row.
    /// A backward takes its row channel by channel where each channel keeps every thread busy,
    /// else whole where its channels come in [`Chunks`].
    pub(super) fn of(r: &RowReduction, vectorised: bool) -> Option<RowCache> {
        if !vectorised {
            return None;
        }
        let held = |span: u64, channels: u64, chunks: Option<Chunks>, threads: &[u64]| {
            threads.iter().find_map(|&threads| {
                let slots = span.div_ceil(threads * UNROLL);
                (channels * slots * UNROLL <= CACHED_VALUES).then_some(RowCache {
                    threads,
                    slots,
                    chunks,
                    warp_rows: false,
                })
            })
        };
        let fewest = [256, 512, 1024];
        let Some(g) = &r.gradients else {
            if r.op != "moments" {
                return None;
            }
            let warp_rows = (held(r.width, 1, None, &[32]))
                .filter(|_| r.column_sums.is_empty())
                .map(|cache| RowCache {
                    threads: 32 * WARP_ROWS,
                    warp_rows: true,
                    ..cache
                });
            return warp_rows.or_else(|| held(r.width, 1, None, &fewest));
        };
        let (hxw, per_group) = (g.shape.hxw, g.shape.channels_per_group());
        let by_channel = held(hxw, per_group, None, &fewest);
        let busy = by_channel.is_some_and(|c| hxw % (c.threads * UNROLL) == 0);
        // A row taken whole runs the most threads that all have elements (else the fewest): its
        // held values then take the fewest registers (a backward of 32 × 32 maps: 190 µs in 512
        // threads, 144 in 1024, on an H200).
        let whole = Chunks::of(hxw, r.width).and_then(|chunks| {
            let mut threads: Vec<u64> = [1024, 512, 256]
                .into_iter()
                .filter(|&t| r.width >= t * UNROLL)
                .collect();
            threads.extend(fewest);
            held(r.width, 1, Some(chunks), &threads)
        });
        match busy {
            true => by_channel,
            false => whole.or(by_channel),
        }
    }

    /// The value an element's functions read as their own (`OWN`): slot `j` (of channel `cl`).
    fn own(&self) -> String {
        format!("held[(cl * {} + j) * {UNROLL} + k]", self.slots)
    }

    /// The head of slot `j` of channel `cl` of a row (`span` elements a channel): its first
    /// column, the guard, and the inputs' groups of four.
    fn slot_head(&self, span: u64, width: u64, groups: &[usize]) -> String {
        let (threads, thread) = self.row_threads();
        let mut head = format!(
            "#pragma unroll\n    for (int j = 0; j < {slots}; ++j) {{\n      const idx_t hw = (j * {threads} + {thread}) * {UNROLL};\n      if (hw >= {span}) continue;\n      const idx_t col = cl * {span} + hw;\n      a.first = row * {width} + col;\n",
            slots = self.slots
        );
        for i in groups {
            writeln!(head, "      a.g{i} = load_group(a.in{i} + a.first);").unwrap();
        }
        head
    }

    /// A group norm's kernel with its row held: one pass computes and sums the row, the variance
    /// sums the held values less the mean, and the results read them (`OWN`).
    fn moments_loop(
        &self,
        r: &RowReduction,
        groups: &[usize],
        whole: &str,
        per_row: &str,
    ) -> String {
        let (width, eps) = (r.width, r.eps as f32);
        let head = self.slot_head(width, width, groups);
        let values = self.slots * UNROLL;
        let (threads, thread) = self.row_threads();
        let each = format!("#pragma unroll\n    for (int j = 0; j < {}; ++j) {{\n      if ((j * {threads} + {thread}) * {UNROLL} >= {width}) continue;\n#pragma unroll\n      for (int k = 0; k < {UNROLL}; ++k) {{\n", self.slots);
        // A warp a row sums in registers and meets no other warp: no shared memory, no barrier.
        let (rows, sum, tail) = match self.warp_rows {
            true => (
                format!("  const int lane = threadIdx.x & 31;\n  const int cl = 0;\n  for (idx_t row = blockIdx.x * {WARP_ROWS} + (threadIdx.x >> 5); row < (idx_t)n; row += gridDim.x * {WARP_ROWS}) {{\n"),
                "warp_sum(acc)",
                format!("    if (lane == 0) {{\n      const idx_t p = row;\n{per_row}    }}\n  }}\n"),
            ),
            false => (
                "  __shared__ float partial[32];\n  const int cl = 0;\n  for (idx_t row = blockIdx.x; row < (idx_t)n; row += gridDim.x) {\n".to_string(),
                "block_sum(acc, partial)",
                row_tail(per_row),
            ),
        };
        format!(
            "{rows}    float held[{values}];
    float acc = 0.f;
    {head}#pragma unroll
      for (int k = 0; k < {UNROLL}; ++k) {{
        held[j * {UNROLL} + k] = in_red(a, row, col + k, NO_ROW);
        acc += held[j * {UNROLL} + k];
      }}
    }}
    const float mean = {sum} / {width}.f;
    acc = 0.f;
    {each}        const float v = held[j * {UNROLL} + k];
        acc += (v - mean) * (v - mean);
      }}
    }}
    const float variance = {sum} / {width}.f;
    const float2 red = make_float2(mean, rsqrtf(fmaxf(variance, 0.f) + {eps:?}f));
    {head}{whole}    }}
{tail}"
        )
    }

    /// The threads a row is spread over and a thread's place among them, as C expressions.
    fn row_threads(&self) -> (&'static str, &'static str) {
        match self.warp_rows {
            true => ("32", "lane"),
            false => ("(idx_t)blockDim.x", "threadIdx.x"),
        }
    }

    /// A group norm's backward's rows taken whole ([`Chunks`]). A block per row computes each of
    /// its elements' gradient once, held, summing `dy * x` and `dy` per slot; adds the slots up
    /// per chunk, then the chunks per channel (in order, so every run gives the same sums), and
    /// keeps each sample's channel terms in the workspace as [`group_norm_backward_loop`] does;
    /// then writes the row's input gradient from the held values, its sums over channels too.
    /// Two block sums a row, where channel by channel took two a channel.
    fn whole_gradient_rows(
        &self,
        chunks: Chunks,
        gradients: &GradientRows,
        groups: &[usize],
        whole: &str,
    ) -> String {
        let GroupNormGradients {
            samples, channels, ..
        } = gradients.shape;
        let (width, per_group) = (
            gradients.shape.width(),
            gradients.shape.channels_per_group(),
        );
        let slots = self.slots;
        let w = channel_read(gradients.weight, "channel", "1.f");
        let (bias_terms, count) = (samples * channels, chunks.count);
        let GradientRowText {
            statistics,
            channel,
            terms,
            coefficients,
        } = GradientRowText::of(gradients);
        let per_channel = gradients.shape.hxw / chunks.elements;
        let head = self.slot_head(width, width, groups);
        let sums =
            chunks.keep(slots, width, "dy_x", 0) + &chunks.keep(slots, width, "dy_sum", count);
        let (mut declare, mut keep, mut total) = (String::new(), String::new(), String::new());
        for t in 0..gradients.channel_sums.len() as u64 {
            writeln!(declare, "    float t{t}[{slots}] = {{}};").unwrap();
            keep.push_str(&chunks.keep(slots, width, &format!("t{t}"), (2 + t) * count));
            writeln!(total, "      float sum{t} = 0.f;\n      for (idx_t q = cl * {per_channel}; q < (cl + 1) * {per_channel}; ++q) sum{t} += chunk[{} + q];\n      ws[1 + {} + sample * {channels} + channel] = sum{t};", (2 + t) * count, (2 + t) * bias_terms).unwrap();
        }
        let totals = match total.is_empty() {
            true => String::new(),
            false => format!("    __syncthreads();\n    for (idx_t cl = threadIdx.x; cl < {per_group}; cl += blockDim.x) {{\n      {channel}\n{total}    }}\n"),
        };
        let arrays = 2 + gradients.channel_sums.len() as u64;
        format!(
            "  __shared__ float partial[32];
  __shared__ float chunk[{}];
  const float s_width = 1.f / {width}.f;
  for (idx_t row = blockIdx.x; row < (idx_t)n; row += gridDim.x) {{
{statistics}    const int cl = 0;
    float held[{}];
    float dy_x[{slots}] = {{}}, dy_sum[{slots}] = {{}};
    {head}#pragma unroll
      for (int k = 0; k < {UNROLL}; ++k) {{
        const float dy = in_dy(a, row, col + k, NO_ROW);
        held[j * {UNROLL} + k] = dy;
        dy_x[j] += dy * in_x(a, row, col + k, NO_ROW);
        dy_sum[j] += dy;
      }}
    }}
{sums}    __syncthreads();
    float weighted_dy_x = 0.f, weighted_dy = 0.f;
    for (idx_t cl = threadIdx.x; cl < {per_group}; cl += blockDim.x) {{
      {channel}
      float s = 0.f, b = 0.f;
      for (idx_t q = cl * {per_channel}; q < (cl + 1) * {per_channel}; ++q) {{
        s += chunk[q];
        b += chunk[{count} + q];
      }}
      const float w = {w};
      weighted_dy_x += s * w;
      weighted_dy += b * w;
      {terms}
    }}
    const float sum_dy_x = block_sum(weighted_dy_x, partial);
    const float sum_dy = block_sum(weighted_dy, partial);
{coefficients}{declare}    {head}{whole}    }}
{keep}{totals}    __syncthreads();
  }}
",
            arrays * count,
            slots * UNROLL,
        )
    }

    /// A group norm's backward's loops with its gradient held: the sums compute each element's
    /// gradient once, the stores read it (`OWN`), one channel after the other too.
    fn gradient_loops(
        &self,
        gradients: &GradientRows,
        groups: &[usize],
        whole: &str,
    ) -> GradientLoops {
        let (hxw, width) = (gradients.shape.hxw, gradients.shape.width());
        let head = self
            .slot_head(hxw, width, groups)
            .replace("\n    ", "\n      ");
        let sums = format!(
            "{head}#pragma unroll\n        for (int k = 0; k < {UNROLL}; ++k) {{\n          const float dy = in_dy(a, row, col + k, NO_ROW);\n          held[(cl * {slots} + j) * {UNROLL} + k] = dy;\n          s += dy * in_x(a, row, col + k, NO_ROW);\n          b += dy;\n        }}\n      }}\n",
            slots = self.slots
        );
        let held = gradients.shape.channels_per_group() * self.slots * UNROLL;
        GradientLoops {
            declare: format!("    float held[{held}];\n"),
            unroll: "#pragma unroll",
            sums,
            stores: format!("{head}{whole}      }}\n"),
        }
    }
}

impl Chunks {
    /// The chunks of a row of `width` elements in channels of `hxw`: a warp's 128 elements where
    /// they divide a channel, or a channel's lanes where a channel (a power of two of four or more
    /// elements) divides a warp's; `None` otherwise, or for more than [`MAX_CHUNKS`].
    fn of(hxw: u64, width: u64) -> Option<Chunks> {
        let warp = 32 * UNROLL;
        let elements = match hxw {
            _ if hxw % warp == 0 => warp,
            _ if hxw >= UNROLL && hxw.is_power_of_two() && hxw < warp => hxw,
            _ => return None,
        };
        let count = width / elements;
        (width % elements == 0 && count <= MAX_CHUNKS).then_some(Chunks { elements, count })
    }

    /// Code adding up each thread's `sums[j]` over its chunk's lanes, the chunk's first lane
    /// keeping the sum in `chunk[first + its chunk]` (shared memory).
    fn keep(&self, slots: u64, width: u64, sums: &str, first: u64) -> String {
        let (lanes, elements) = (self.elements / UNROLL, self.elements);
        format!(
            "    #pragma unroll
    for (int j = 0; j < {slots}; ++j) {{
      const idx_t hw = (j * (idx_t)blockDim.x + threadIdx.x) * {UNROLL};
      const float v = lane_sum<{lanes}>({sums}[j]);
      if (hw < {width} && threadIdx.x % {lanes} == 0) chunk[{first} + hw / {elements}] = v;
    }}
"
        )
    }
}

/// The head of a row's loop over its `width` columns: one at a time a block apart, or (vectorised)
/// four neighbours at a time, the inputs' groups of four loaded first.
fn column_loop(width: u64, vectorised: bool, groups: &[usize]) -> String {
    if !vectorised {
        return format!("for (idx_t col = threadIdx.x; col < {width}; col += blockDim.x) {{\n");
    }
    let mut head = format!(
        "for (idx_t col = threadIdx.x * {UNROLL}; col < {width}; col += blockDim.x * {UNROLL}) {{\n      a.first = row * {width} + col;\n"
    );
    for i in groups {
        writeln!(head, "      a.g{i} = load_group(a.in{i} + a.first);").unwrap();
    }
    head
}

/// The stores of a row-reduction kernel: those of its column loop (every value first, then the
/// stores, as in [`pointwise_loop`]; `own`, the element's held value, set first, and stored as it
/// is where it is a result's value ([`StoredResult::held`]); the `accumulate` lines of a group
/// norm's backward's channel sums after) and those of the row's one thread.
fn row_stores(
    stored: &[StoredResult],
    width: u64,
    vectorised: bool,
    own: Option<String>,
    accumulate: &str,
) -> (String, String) {
    let (mut values, mut stores) = (String::new(), String::new());
    let (mut per_row, mut per_row_stores) = (String::new(), String::new());
    let mut columns = String::new();
    for s in stored.iter().filter(|s| s.channel.is_none()) {
        let (i, f, ty) = (s.arg, s.function, s.ty);
        if s.per_row {
            writeln!(per_row, "      const float r{i} = v{f}(a, p, red);").unwrap();
            writeln!(per_row_stores, "      a.out{i}[p] = store_as<{ty}>(r{i});").unwrap();
        } else if vectorised {
            writeln!(values, "      float r{i}[{UNROLL}];").unwrap();
            match s.held && own.is_some() {
                true => writeln!(columns, "        r{i}[k] = a.own0;").unwrap(),
                false => writeln!(columns, "        r{i}[k] = v{f}(a, p, red);").unwrap(),
            }
            writeln!(stores, "      store4(a.out{i} + a.first, r{i});").unwrap();
        } else {
            writeln!(values, "      const float r{i} = v{f}(a, p, red);").unwrap();
            writeln!(stores, "      a.out{i}[p] = store_as<{ty}>(r{i});").unwrap();
        }
    }
    let whole = if vectorised {
        let own = own.map_or(String::new(), |own| format!("        a.own0 = {own};\n"));
        format!("{values}#pragma unroll\n      for (int k = 0; k < {UNROLL}; ++k) {{\n        const idx_t p = a.first + k;\n{own}{columns}{accumulate}      }}\n{stores}")
    } else {
        format!("      const idx_t p = row * {width} + col;\n{values}{accumulate}{stores}")
    };
    (whole, per_row + &per_row_stores)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows of `width` columns, summed over columns `sums` times with no reduction of their own.
    fn columns(rows: u64, width: u64, sums: usize) -> RowReduction {
        RowReduction {
            rows,
            width,
            op: "columns",
            eps: 0.0,
            gradients: None,
            column_sums: vec!["v".into(); sums],
        }
    }

    #[test]
    fn a_finish_in_slices_sums_every_block_once() {
        for (blocks, width) in [(1024, 768), (1024, 3072), (10, 40), (17, 768), (1, 8)] {
            let plan = FinishPlan::of(&columns(blocks, width, 1), blocks);
            let per = blocks.div_ceil(plan.slices);
            // The slices cover the blocks, none of them past the last.
            assert!(per * plan.slices >= blocks, "{blocks} blocks of {width}");
            assert!(
                per * (plan.slices - 1) < blocks,
                "{blocks} blocks of {width}"
            );
            assert!(plan.finish_blocks() <= FINISH_BLOCKS.max(plan.tiles));
        }
    }

    #[test]
    fn a_finish_of_one_slice_takes_no_slice_sums_or_counters() {
        // 264 tiles of 32 columns fill the finish's blocks at one slice each.
        let wide = FinishPlan::of(&columns(1024, 32 * 264, 1), 1024);
        assert_eq!(wide.slices, 1);
        assert_eq!(wide.workspace(), 1024 * 32 * 264);
        assert!(wide.zero_counters().is_empty());
        let narrow = FinishPlan::of(&columns(1024, 768, 3), 1024);
        assert!(narrow.slices > 1);
        let counters = narrow.tiles;
        assert_eq!(
            narrow.workspace(),
            3 * 1024 * 768 + 3 * narrow.slices * 768 + counters
        );
        assert!(narrow.zero_counters().contains("0u"));
    }

    #[test]
    fn rows_summed_alone_run_in_strips_of_at_most_their_rows_blocks() {
        for (rows, width, vector) in [(8192, 3072, 8), (8192, 768, 4), (10, 4096, 8), (3, 40, 4)] {
            let r = columns(rows, width, 2);
            let Some(strips) = ColumnStrips::of(&r, true, vector) else {
                // Fewer rows than tiles: a block a row.
                assert!(rows < width.div_ceil(32 * vector), "{rows} rows of {width}");
                continue;
            };
            assert!(
                strips.blocks() <= rows,
                "{rows} rows of {width}: {strips:?}"
            );
            assert!(strips.tiles * 32 * vector >= width);
        }
    }

    #[test]
    fn rows_with_a_reduction_of_their_own_or_too_many_sums_are_not_run_in_strips() {
        let norm = RowReduction {
            op: "sum",
            ..columns(8192, 768, 1)
        };
        assert_eq!(ColumnStrips::of(&norm, true, 4), None);
        // Eight columns a lane, five sums: 40 floats, past the registers a lane keeps them in.
        assert_eq!(ColumnStrips::of(&columns(8192, 768, 5), true, 8), None);
        assert!(ColumnStrips::of(&columns(8192, 768, 5), true, 4).is_some());
        // Not vectorised (an odd width): the row kernel's own loop.
        assert_eq!(ColumnStrips::of(&columns(8192, 77, 1), false, 4), None);
    }

    #[test]
    fn a_layer_norms_backward_takes_a_thread_per_four_columns_in_whole_warps() {
        let norm = |width| RowReduction {
            op: "layer_norm_backward",
            ..columns(8192, width, 2)
        };
        assert_eq!(layer_norm_backward_threads(&norm(768), true), Some(192));
        assert_eq!(layer_norm_backward_threads(&norm(1000), true), Some(256));
        assert_eq!(layer_norm_backward_threads(&norm(96), true), Some(32));
        assert_eq!(layer_norm_backward_threads(&norm(8192), true), None);
        assert_eq!(layer_norm_backward_threads(&norm(77), false), None);
    }
}
