//! The diff engine's scoring on the GPU (kernels/score.cu): every captured slot against every
//! candidate reference state in one pass, returning the sums `x.x`, `x.c`, `c.c` and the row
//! count per (slot, candidate), from which [`crate::score::Score::from_sums`] derives cosine, relative error
//! and norm ratio exactly as [`crate::score::score_all`] does.

pub use crate::score::PairSums;
use candle_core::{DType, Device, Result, Tensor};

/// Which partial-sums kernel of kernels/score.cu runs on a CUDA device (the same sums, added
/// in another order: they agree to f32 rounding).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScoreKernel {
    /// `score_partials`: one block per (chunk, slot, four candidates).
    PerSlot,
    /// `score_partials_vec`: one block per (four candidates, chunk, four slots), float4 reads,
    /// each reference value read once for every slot of the block; rows whose columns, stride
    /// or base are not 16-byte multiples take `PerSlot` instead.
    Vec4,
}

/// Where the slots and the reference states sit.
#[derive(Clone, Copy, Debug)]
pub struct ScoreShape {
    /// Captured rows.
    pub rows: usize,
    /// Columns of one slot; slot s is columns `s * cols .. (s + 1) * cols` of `x`.
    pub cols: usize,
    pub slots: usize,
    pub x_stride: usize,
    pub n_states: usize,
    pub ref_rows: usize,
    /// Row stride of the references (state q row r at `(q * ref_rows + r) * ref_stride`).
    pub ref_stride: usize,
}

/// The CPU reference, with `score_all`'s arithmetic: per row, f64 sums over the columns
/// (skipping non-finite captured values), added to the pair's totals row by row. Candidates are
/// `(state, shift)`: captured row t pairs with reference row t + shift. Returns the pairs
/// slot-major (`[slots, candidates]`).
pub fn score_slots_ref(
    x: &[f32],
    refs: &[f32],
    s: &ScoreShape,
    candidates: &[(usize, isize)],
) -> Vec<PairSums> {
    let mut out = vec![PairSums::default(); s.slots * candidates.len()];
    for slot in 0..s.slots {
        for (j, &(state, shift)) in candidates.iter().enumerate() {
            let pair = &mut out[slot * candidates.len() + j];
            for t in 0..s.rows {
                let rt = t as isize + shift;
                if rt < 0 || rt as usize >= s.ref_rows {
                    continue;
                }
                let xr = &x[t * s.x_stride + slot * s.cols..][..s.cols];
                let cr = &refs[(state * s.ref_rows + rt as usize) * s.ref_stride..][..s.cols];
                let (mut a, mut b, mut c) = (0f64, 0f64, 0f64);
                for (&xv, &cv) in xr.iter().zip(cr) {
                    if !xv.is_finite() {
                        continue;
                    }
                    let (xv, cv) = (f64::from(xv), f64::from(cv));
                    a += xv * xv;
                    b += xv * cv;
                    c += cv * cv;
                }
                pair.xx += a;
                pair.xc += b;
                pair.cc += c;
                pair.rows += 1;
            }
        }
    }
    out
}

/// The CPU form of [`score_slots`] on host buffers laid out as [`score_slots_ref`] takes them:
/// [`crate::score::pair_sums`], the matrix-product pass (f32 products summed per row,
/// rows in f64), so it agrees with the reference to about 1e-6 relative, as the GPU does.
pub fn score_slots_cpu(
    x: &[f32],
    refs: &[f32],
    s: &ScoreShape,
    candidates: &[(usize, isize)],
) -> Vec<PairSums> {
    use crate::score::{View, pair_sums};
    let xs: Vec<View> = (0..s.slots)
        .map(|slot| View {
            data: x,
            rows: s.rows,
            stride: s.x_stride,
            col: slot * s.cols,
            cols: s.cols,
        })
        .collect();
    let per_state = s.ref_rows * s.ref_stride;
    let states: Vec<View> = (0..s.n_states)
        .map(|q| View {
            data: &refs[q * per_state..(q + 1) * per_state],
            rows: s.ref_rows,
            stride: s.ref_stride,
            col: 0,
            cols: s.cols,
        })
        .collect();
    pair_sums(&xs, &states, candidates)
}

/// The kernel [`score_jobs`] launches for f32 sums.
pub const SCORE_KERNEL: ScoreKernel = ScoreKernel::Vec4;

/// How a launch sums: f32 per thread before a double reduction (the scoring), or f64
/// products and sums throughout (the exact rescoring of a best candidate, `score_all`'s
/// arithmetic).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    F32,
    F64,
}

/// One set of slots against its own reference states: `x` `[rows, >= slots * cols]` (any row
/// stride), `states` each `[ref_rows, >= cols]` with one row stride, candidates `(index into
/// states, shift)`. A batch of samples is one job per sample, scored in one launch. The values
/// are f32 or bf16 ([`Elems`]): a bf16 value widens to f32 exactly, so the sums are those of
/// the widened tensors.
#[derive(Clone)]
pub struct Job<'a> {
    pub x: &'a Tensor,
    pub states: Vec<&'a Tensor>,
    pub candidates: Vec<(usize, isize)>,
    /// Empty (the slots are columns of `x`), or per slot the state read as it (its columns
    /// `0..cols`): several states against the others in one job, each read once. `x` then only
    /// gives the rows and their type: one of the states.
    pub slot_states: Vec<usize>,
    /// The job's own slot count, at most the launch's (`None`: the launch's). Jobs of several
    /// slot counts share one launch (a sample's three aux slots and its one training target
    /// read the flush's states once); each gets its own count's sums back.
    pub slots: Option<usize>,
}

impl<'a> Job<'a> {
    /// Slots that are columns of `x`.
    pub fn new(x: &'a Tensor, states: Vec<&'a Tensor>, candidates: Vec<(usize, isize)>) -> Job<'a> {
        Job {
            x,
            states,
            candidates,
            slot_states: Vec::new(),
            slots: None,
        }
    }

    /// The job with `slots` slots of its own (see [`Job::slots`]).
    pub fn with_slots(self, slots: usize) -> Job<'a> {
        Job {
            slots: Some(slots),
            ..self
        }
    }

    /// The slots the job scores in a launch of `launch` slots.
    pub fn own_slots(&self, launch: usize) -> usize {
        self.slots.unwrap_or(launch)
    }
}

/// Scores `slots` slots of `cols` columns of `x`: `[rows, >= slots * cols]` f32 (any row
/// stride) against `refs`: `[n_states, ref_rows, >= cols]` f32 for every candidate
/// `(state, shift)`. Returns the sums slot-major (`[slots, candidates]`), on the host.
///
/// On the GPU each thread sums in f32 before a double reduction (the CPU sums each row in f64),
/// so the sums agree to about 1e-6 relative, not bit for bit.
pub fn score_slots(
    x: &Tensor,
    slots: usize,
    cols: usize,
    refs: &Tensor,
    candidates: &[(usize, isize)],
) -> Result<Vec<PairSums>> {
    let n_states = refs.dims3()?.0;
    let states = (0..n_states)
        .map(|q| refs.get(q))
        .collect::<Result<Vec<_>>>()?;
    let job = Job::new(x, states.iter().collect(), candidates.to_vec());
    let mut out = score_jobs(&[job], slots, cols, Precision::F32)?;
    Ok(out.pop().unwrap_or_default())
}

/// Every job's slots against its candidates, in one launch on a GPU (one read-back for all):
/// per job the sums slot-major (`[slots, candidates]`), on the host.
pub fn score_jobs(
    jobs: &[Job],
    slots: usize,
    cols: usize,
    precision: Precision,
) -> Result<Vec<Vec<PairSums>>> {
    score_jobs_with(jobs, slots, cols, precision, SCORE_KERNEL, 0).map(|(sums, _)| sums)
}

/// [`score_jobs`] over every row and, in the same pass, over the interior rows `edge..rows -
/// edge` alone (each captured row t still paired with state row t + shift; no interior when
/// rows < 2 * edge): per job every row's sums followed by the interior's, each slot-major. One
/// read of the slots and states for both, where two jobs would read them twice.
pub fn score_jobs_split(
    jobs: &[Job],
    slots: usize,
    cols: usize,
    precision: Precision,
    edge: usize,
) -> Result<Vec<Vec<PairSums>>> {
    if edge == 0 {
        candle_core::bail!("score_jobs_split: an edge of 0 rows has no interior to split");
    }
    score_jobs_with(jobs, slots, cols, precision, SCORE_KERNEL, edge).map(|(sums, _)| sums)
}

/// Rows `0..edge` and `rows - edge..rows` of every state (each `[rows, h]` with `rows >= edge`,
/// all of one shape, type and device), as one tensor `[2 * edge * n, h]`: state i's head then
/// tail rows at rows `2 * edge * i..`. On a GPU in one launch for all where every state is
/// contiguous and the copies are whole 16-byte words (kernels/score.cu `gather_blocks`; a join
/// of two narrows per state took 12-13 us a state, run 49); elsewhere each state's rows joined.
pub fn edge_rows_all(states: &[&Tensor], edge: usize) -> Result<Tensor> {
    let Some(first) = states.first() else {
        candle_core::bail!("edge_rows_all: no states");
    };
    let (rows, _) = first.dims2()?;
    if rows < edge {
        candle_core::bail!("edge_rows_all: {edge} edge rows of {rows}");
    }
    for t in states {
        if t.dims() != first.dims()
            || t.dtype() != first.dtype()
            || !t.device().same_device(first.device())
        {
            candle_core::bail!(
                "edge_rows_all: a state {:?} {:?} among {:?} {:?}",
                t.dims(),
                t.dtype(),
                first.dims(),
                first.dtype()
            );
        }
    }
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = first.device()
        && let Some(t) = edge_rows_on_gpu(dev, states, first.dims2()?, edge)?
    {
        return Ok(t);
    }
    let parts = states
        .iter()
        .flat_map(|t| [t.narrow(0, 0, edge), t.narrow(0, rows - edge, edge)])
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&parts, 0)
}

/// [`edge_rows_all`] in one `gather_blocks` launch; `None` where a state is not contiguous, a
/// copy is not whole 16-byte words, or there are more copies than a grid's column.
#[cfg(feature = "cuda")]
fn edge_rows_on_gpu(
    dev: &candle_core::CudaDevice,
    states: &[&Tensor],
    (rows, h): (usize, usize),
    edge: usize,
) -> Result<Option<Tensor>> {
    use super::cuda::{Module, alloc, cfg, function, launch, storage_ptr, tensor, tensor_ptr};
    let dtype = states[0].dtype();
    let bytes = edge * h * dtype.size_in_bytes();
    let tail = ((rows - edge) * h * dtype.size_in_bytes()) as u64;
    let copies = 2 * states.len();
    if bytes == 0 || !bytes.is_multiple_of(16) || !tail.is_multiple_of(16) || copies > MAX_GROUPS {
        return Ok(None);
    }
    let mut src = Vec::with_capacity(copies);
    for t in states {
        let p = tensor_ptr(t)?;
        if !t.is_contiguous() || !p.is_multiple_of(16) {
            return Ok(None);
        }
        for at in [p, p + tail] {
            src.push(launch::addr(at)?);
        }
    }
    let gpu = Device::Cuda(dev.clone());
    let table = Tensor::new(src.as_slice(), &gpu)?;
    let out = alloc(dev, dtype, copies * edge * h)?;
    let words = bytes / 16;
    let x = words.div_ceil(256).min(64);
    let func = function(dev, Module::Score, "gather_blocks")?;
    launch!(
        dev,
        func,
        "gather_blocks",
        cfg((x as u32, copies as u32, 1), 256, 0)?,
        [tensor_ptr(&table)?, bytes as i64, storage_ptr(&out, 0)?,]
    );
    Ok(Some(tensor(out, (copies * edge, h))))
}

/// The element types a launch reads (kernels/score.cu's entry points): the captured rows and
/// the states both f32, f32 rows against bf16 states (a forward's states as it made them), or
/// both bf16 (a state read as a slot).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Elems {
    F32,
    F32Bf16,
    Bf16,
}

impl Elems {
    /// The pair `x` and `states` are, when the kernels read it.
    pub fn of(x: DType, states: DType) -> Option<Elems> {
        match (x, states) {
            (DType::F32, DType::F32) => Some(Elems::F32),
            (DType::F32, DType::BF16) => Some(Elems::F32Bf16),
            (DType::BF16, DType::BF16) => Some(Elems::Bf16),
            _ => None,
        }
    }

    /// The entry points' suffix (kernels/score.cu `SCORE_ENTRIES`).
    #[cfg(feature = "cuda")]
    fn suffix(self) -> &'static str {
        match self {
            Elems::F32 => "",
            Elems::F32Bf16 => "_fb",
            Elems::Bf16 => "_bb",
        }
    }
}

/// Where one job's rows sit.
struct JobShape {
    /// The job's own slot count.
    slots: usize,
    x: super::Matrix,
    ref_rows: usize,
    ref_stride: usize,
    states: Vec<super::Matrix>,
    elems: Elems,
}

/// Checks a job against a launch of `launch` slots x `cols` and reads its layouts.
fn job_shape(job: &Job, launch: usize, cols: usize) -> Result<JobShape> {
    let slots = job.own_slots(launch);
    if slots > launch {
        candle_core::bail!(
            "score_jobs: a job of {slots} slots in a launch of {launch}: no job may have more \
             slots than its launch"
        );
    }
    let state_dtype = job.states.first().map_or(job.x.dtype(), |t| t.dtype());
    let elems = Elems::of(job.x.dtype(), state_dtype);
    let Some(elems) = elems.filter(|_| job.states.iter().all(|t| t.dtype() == state_dtype)) else {
        candle_core::bail!(
            "score_jobs: x {:?} against states {:?}: the kernels read f32 or bf16 states, \
             all of one type, and f32 slots or slots of the states' type",
            job.x.dtype(),
            job.states.iter().map(|t| t.dtype()).collect::<Vec<_>>()
        );
    };
    let x = super::Matrix::of(job.x.layout(), "score x")?;
    let slot_cols = if job.slot_states.is_empty() {
        slots * cols
    } else {
        cols
    };
    if job.x.rank() != 2 || x.cols < slot_cols {
        candle_core::bail!(
            "score_jobs: {slots} slots of {cols} need [rows, >= {}] of x, found {:?}",
            slot_cols,
            job.x.dims()
        );
    }
    let states = job
        .states
        .iter()
        .map(|s| super::Matrix::of(s.layout(), "score state"))
        .collect::<Result<Vec<_>>>()?;
    let (ref_rows, ref_stride) = states.first().map_or((0, cols), |m| (m.rows, m.stride));
    for (q, (m, t)) in states.iter().zip(&job.states).enumerate() {
        if t.rank() != 2 || m.rows != ref_rows || m.cols < cols || m.stride != ref_stride {
            candle_core::bail!(
                "score_jobs: state {q} is {:?} (row stride {}), where the job's states are \
                 [{ref_rows}, >= {cols}] with row stride {ref_stride}",
                t.dims(),
                m.stride
            );
        }
    }
    if !job.slot_states.is_empty()
        && (job.slot_states.len() != slots
            || job.slot_states.iter().any(|&q| q >= states.len())
            || (x.rows, x.stride) != (ref_rows, ref_stride))
    {
        candle_core::bail!(
            "score_jobs: slot states {:?} for {slots} slots of {} states, x {:?} (row stride {}) \
             one of them",
            job.slot_states,
            states.len(),
            job.x.dims(),
            x.stride
        );
    }
    if let Some(&(q, _)) = job.candidates.iter().find(|(q, _)| *q >= states.len()) {
        candle_core::bail!(
            "score_jobs: candidate state {q} outside 0..{}",
            states.len()
        );
    }
    Ok(JobShape {
        slots,
        x,
        ref_rows,
        ref_stride,
        states,
        elems,
    })
}

/// [`score_jobs`] with the f32 kernel chosen (the tests run both); returns the kernel that ran
/// (`None` on the CPU). With an `edge`, each job's sums are [`score_jobs_split`]'s.
fn score_jobs_with(
    jobs: &[Job],
    slots: usize,
    cols: usize,
    precision: Precision,
    kernel: ScoreKernel,
    edge: usize,
) -> Result<(Vec<Vec<PairSums>>, Option<ScoreKernel>)> {
    let Some(first) = jobs.first() else {
        return Ok((Vec::new(), None));
    };
    match first.x.device() {
        Device::Cpu => {
            let _ = kernel; // one CPU pass
            let sums = jobs
                .iter()
                .map(|job| {
                    // States read as slots (checked first): their columns side by side, as
                    // slots of x are. Each job scores its own slot count.
                    let slots = job_shape(job, slots, cols)?.slots;
                    let packed = (!job.slot_states.is_empty())
                        .then(|| {
                            let parts = job
                                .slot_states
                                .iter()
                                .map(|&q| job.states[q].narrow(1, 0, cols))
                                .collect::<Result<Vec<_>>>()?;
                            Tensor::cat(&parts, 1)
                        })
                        .transpose()?;
                    let packed_job = packed
                        .as_ref()
                        .map(|x| Job::new(x, job.states.clone(), job.candidates.clone()));
                    let job = packed_job.as_ref().unwrap_or(job);
                    let mut sums = score_job_cpu(job, slots, cols, precision)?;
                    if edge > 0 {
                        sums.extend(interior_cpu(job, slots, cols, precision, edge)?);
                    }
                    Ok(sums)
                })
                .collect::<Result<_>>()?;
            Ok((sums, None))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => {
            let counts: Vec<usize> = jobs.iter().map(|j| j.candidates.len()).collect();
            let (mut sums, mut ran) = (Vec::with_capacity(jobs.len()), kernel);
            for part in launches(&counts) {
                // Every launch chooses its kernel by the same alignment rule.
                let (part, k) =
                    score_on_gpu(dev, &jobs[part], slots, cols, precision, kernel, edge)?;
                sums.extend(part);
                ran = k;
            }
            Ok((sums, Some(ran)))
        }
        other => candle_core::bail!("score_jobs: no kernel for {:?}", other.location()),
    }
}

/// The rows of `m` from `t`'s storage on the host, each `stride` apart (`rows * stride`
/// values, the last row's tail zero).
fn host_rows(t: &Tensor, m: &super::Matrix, what: &str) -> Result<Vec<f32>> {
    let (storage, _) = t.storage_and_layout();
    let candle_core::Storage::Cpu(c) = &*storage else {
        candle_core::bail!("{what}: expected a CPU tensor");
    };
    let mut v = m.slice(c.as_slice::<f32>()?, what)?.to_vec();
    v.resize(m.rows * m.stride, 0.0);
    Ok(v)
}

/// One job on the CPU: [`score_slots_cpu`] (f32) or [`score_slots_ref`] (f64).
fn score_job_cpu(
    job: &Job,
    slots: usize,
    cols: usize,
    precision: Precision,
) -> Result<Vec<PairSums>> {
    let s = job_shape(job, slots, cols)?;
    if s.elems != Elems::F32 {
        // bf16 widens to f32 exactly: the same sums as the widened tensors'.
        let x = job.x.to_dtype(DType::F32)?;
        let states = job
            .states
            .iter()
            .map(|t| t.to_dtype(DType::F32))
            .collect::<Result<Vec<_>>>()?;
        let widened = Job::new(&x, states.iter().collect(), job.candidates.clone());
        return score_job_cpu(&widened, slots, cols, precision);
    }
    let x = host_rows(job.x, &s.x, "score x")?;
    let mut refs = Vec::with_capacity(s.states.len() * s.ref_rows * s.ref_stride);
    for (t, m) in job.states.iter().zip(&s.states) {
        refs.extend(host_rows(t, m, "score state")?);
    }
    let shape = ScoreShape {
        rows: s.x.rows,
        cols,
        slots,
        x_stride: s.x.stride,
        n_states: s.states.len(),
        ref_rows: s.ref_rows,
        ref_stride: s.ref_stride,
    };
    Ok(match precision {
        Precision::F32 => score_slots_cpu(&x, &refs, &shape, &job.candidates),
        Precision::F64 => score_slots_ref(&x, &refs, &shape, &job.candidates),
    })
}

/// One job's sums over its interior rows `edge..rows - edge` on the CPU: the job with those rows
/// of `x` alone and every shift moved by `edge`, so that each row keeps its state row.
fn interior_cpu(
    job: &Job,
    slots: usize,
    cols: usize,
    precision: Precision,
    edge: usize,
) -> Result<Vec<PairSums>> {
    let rows = job.x.dim(0)?;
    if rows < 2 * edge {
        return Ok(vec![PairSums::default(); slots * job.candidates.len()]);
    }
    let x = job.x.narrow(0, edge, rows - 2 * edge)?;
    let moved = job
        .candidates
        .iter()
        .map(|&(q, shift)| (q, shift + edge as isize))
        .collect();
    let inner = Job::new(&x, job.states.clone(), moved);
    score_job_cpu(&inner, slots, cols, precision)
}

/// Candidates per block (kernels/score.cu `SCORE_GROUP`): each job's candidates start a new
/// group.
#[cfg(any(feature = "cuda", test))]
const SCORE_GROUP: usize = 4;

/// Candidate groups one launch takes at most (a grid's y and z dimensions).
#[cfg(any(feature = "cuda", test))]
const MAX_GROUPS: usize = 65_535;

/// The jobs (of `candidates[i]` candidates each) split into as few consecutive launches as the
/// grid allows: one for a diff's flush. A job larger than a launch goes alone (its launch then
/// refuses the grid).
#[cfg(any(feature = "cuda", test))]
fn launches(candidates: &[usize]) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut groups) = (0, 0);
    for (i, n) in candidates.iter().enumerate() {
        let g = n.div_ceil(SCORE_GROUP);
        if groups + g > MAX_GROUPS && i > start {
            out.push(start..i);
            (start, groups) = (i, 0);
        }
        groups += g;
    }
    out.push(start..candidates.len());
    out
}

/// Every job in one launch: the candidate, job and state tables in one upload, the sums in one
/// read-back.
#[cfg(feature = "cuda")]
fn score_on_gpu(
    dev: &candle_core::CudaDevice,
    jobs: &[Job],
    slots: usize,
    cols: usize,
    precision: Precision,
    kernel: ScoreKernel,
    edge: usize,
) -> Result<(Vec<Vec<PairSums>>, ScoreKernel)> {
    use super::cuda;
    let table = launch::Table::of(jobs, slots, cols)?;
    let n = table.n_cand;
    if n == 0 || slots == 0 {
        return Ok((jobs.iter().map(|_| Vec::new()).collect(), kernel));
    }
    let gpu = Device::Cuda(dev.clone());
    let uploaded = Tensor::new(table.values.as_slice(), &gpu)?;
    let base = cuda::tensor_ptr(&uploaded)?;
    let ws = cuda::alloc(
        dev,
        DType::F64,
        launch::score_workspace_len(table.max_rows, slots, n, edge),
    )?;
    // Per pair xx, xc, cc and rows; with an edge the interior's four after them.
    let width = if edge > 0 { 8 } else { 4 };
    let out = cuda::alloc(dev, DType::F64, slots * n * width)?;
    let args = table.args(
        base,
        slots,
        cols,
        edge,
        cuda::storage_ptr(&ws, 0)?,
        cuda::storage_ptr(&out, 0)?,
    );
    let ran = launch::score(dev, &args, precision, kernel)?;
    let sums = cuda::tensor(out, slots * n * width).to_vec1::<f64>()?;
    let sums: Vec<PairSums> = sums
        .chunks(4)
        .map(|v| PairSums {
            xx: v[0],
            xc: v[1],
            cc: v[2],
            rows: v[3].max(0.0) as usize,
        })
        .collect();
    // Back from the padded global list to each job's own, slot-major (every row's, then with an
    // edge the interior's: sums holds them interleaved per pair).
    let halves = width / 4;
    let per_job = table
        .place
        .iter()
        .zip(jobs)
        .map(|(&at, job)| {
            let m = job.candidates.len();
            (0..halves)
                .flat_map(|h| {
                    let sums = &sums;
                    (0..job.own_slots(slots)).flat_map(move |s| {
                        (0..m).map(move |j| sums[((s * n + at + j) * halves) + h])
                    })
                })
                .collect()
        })
        .collect();
    Ok((per_job, ran))
}

/// The launch of `score_partials`, `score_partials_f64`, `score_partials_vec` and
/// `score_finish` (kernels/score.cu) from raw device pointers: the tables they read, their
/// arguments and the launch on the device's stream. [`score_jobs`] calls it.
#[cfg(feature = "cuda")]
pub mod launch {
    use super::{Elems, Job, Precision, SCORE_GROUP, ScoreKernel, job_shape};
    use crate::kernels::cuda::{DevPtr, Module, cfg, function, grid_dim, grid_dim_yz, launch};
    use crate::kernels::{to_i32, to_i64};
    use candle_core::Result;
    use candle_core::cuda_backend::CudaDevice;

    /// The kernels' tables, as one i64 buffer: `[3, n_cand]` candidates (state, shift, job),
    /// `[7, n_jobs]` jobs (x address, x stride, rows, ref rows, ref stride, first slot state
    /// or -1, slot count), `[n_states]` state addresses (a job's states, then those it reads
    /// as slots).
    pub struct Table {
        pub values: Vec<i64>,
        pub n_cand: usize,
        pub n_jobs: usize,
        pub n_states: usize,
        /// Where each job's first candidate sits in the padded list.
        pub place: Vec<usize>,
        pub max_rows: usize,
        /// Every address a multiple of four values and every stride a multiple of 4 (reads of
        /// four values at once).
        pub aligned: bool,
        /// What every job's rows and states are.
        pub elems: Elems,
    }

    /// A device address as the kernels' tables hold it.
    pub(super) fn addr(p: DevPtr) -> Result<i64> {
        i64::try_from(p).map_err(|_| candle_core::Error::Msg(format!("address {p:#x}")))
    }

    impl Table {
        /// The tables of `jobs` (each checked against `slots` x `cols`).
        pub fn of(jobs: &[Job], slots: usize, cols: usize) -> Result<Table> {
            let mut cand: [Vec<i64>; 3] = Default::default();
            let mut state_ptr = Vec::new();
            let mut job_cols: [Vec<i64>; 7] = Default::default();
            let mut place = Vec::with_capacity(jobs.len());
            let (mut aligned, mut max_rows) = (true, 0);
            let mut elems = None;
            for (i, job) in jobs.iter().enumerate() {
                let s = job_shape(job, slots, cols)?;
                if *elems.get_or_insert(s.elems) != s.elems {
                    candle_core::bail!(
                        "score_jobs: one launch reads one element type, found {:?} and {:?}",
                        elems,
                        s.elems
                    );
                }
                let base = state_ptr.len() as i64;
                for t in &job.states {
                    let p = crate::kernels::cuda::tensor_ptr(t)?;
                    aligned &= p.is_multiple_of(4 * t.dtype().size_in_bytes() as u64);
                    state_ptr.push(addr(p)?);
                }
                place.push(cand[0].len());
                for &(q, d) in &job.candidates {
                    cand[0].push(base + q as i64);
                    cand[1].push(d as i64);
                    cand[2].push(i as i64);
                }
                while !cand[0].len().is_multiple_of(SCORE_GROUP) {
                    cand[0].push(-1);
                    cand[1].push(0);
                    cand[2].push(i as i64);
                }
                let x = crate::kernels::cuda::tensor_ptr(job.x)?;
                aligned &= x.is_multiple_of(4 * job.x.dtype().size_in_bytes() as u64)
                    && s.x.stride.is_multiple_of(4)
                    && s.ref_stride.is_multiple_of(4);
                max_rows = max_rows.max(s.x.rows);
                // States read as slots: their addresses again, in slot order, after the job's.
                let slot0 = if job.slot_states.is_empty() {
                    -1
                } else {
                    let at = state_ptr.len() as i64;
                    for &q in &job.slot_states {
                        state_ptr.push(state_ptr[base as usize + q]);
                    }
                    at
                };
                for (col, v) in job_cols.iter_mut().zip([
                    addr(x)?,
                    to_i64(s.x.stride, "x stride")?,
                    to_i64(s.x.rows, "rows")?,
                    to_i64(s.ref_rows, "ref rows")?,
                    to_i64(s.ref_stride, "ref stride")?,
                    slot0,
                    to_i64(s.slots, "slots")?,
                ]) {
                    col.push(v);
                }
            }
            let (n_cand, n_jobs, n_states) = (cand[0].len(), jobs.len(), state_ptr.len());
            let values = cand
                .into_iter()
                .chain(job_cols)
                .flatten()
                .chain(state_ptr)
                .collect();
            Ok(Table {
                values,
                n_cand,
                n_jobs,
                n_states,
                place,
                max_rows,
                aligned,
                elems: elems.unwrap_or(Elems::F32),
            })
        }

        /// The launch's arguments with the table uploaded at `base`.
        pub fn args(
            &self,
            base: DevPtr,
            slots: usize,
            cols: usize,
            edge: usize,
            workspace: DevPtr,
            out: DevPtr,
        ) -> ScoreArgs {
            let at = |i: usize| base + 8 * i as u64;
            ScoreArgs {
                cand: at(0),
                n_cand: self.n_cand,
                jobs: at(3 * self.n_cand),
                n_jobs: self.n_jobs,
                state_ptr: at(3 * self.n_cand + 7 * self.n_jobs),
                n_states: self.n_states,
                cols,
                slots,
                max_rows: self.max_rows,
                aligned: self.aligned && cols.is_multiple_of(4),
                elems: self.elems,
                edge,
                workspace,
                out,
            }
        }
    }

    /// `score_partials*` + `score_finish`: see kernels/score.cu. `cand`, `jobs` and
    /// `state_ptr` point into the uploaded [`Table`]; writes `out` `[slots, n_cand, 4]` f64
    /// (`[slots, n_cand, 8]` with an edge: the interior's four after every row's), using
    /// `workspace` (`score_workspace_len` doubles).
    #[derive(Clone, Copy, Debug)]
    pub struct ScoreArgs {
        pub cand: DevPtr,
        pub n_cand: usize,
        pub jobs: DevPtr,
        pub n_jobs: usize,
        pub state_ptr: DevPtr,
        pub n_states: usize,
        pub cols: usize,
        pub slots: usize,
        /// The most rows of any job: the chunks of the grid.
        pub max_rows: usize,
        /// The vector kernel may read every row four values at a time.
        pub aligned: bool,
        pub elems: Elems,
        /// 0, or the rows at each end left out of the interior's sums.
        pub edge: usize,
        pub workspace: DevPtr,
        pub out: DevPtr,
    }

    /// Captured rows per block of `score_partials`.
    const SCORE_ROWS_PER_CHUNK: usize = 32;

    /// The chunks of a launch over jobs of at most `rows` rows (kernels/score.cu
    /// `chunk_span`): with an edge, the head and the tail, then the interior's.
    fn chunks(rows: usize, edge: usize) -> usize {
        if edge == 0 {
            return rows.div_ceil(SCORE_ROWS_PER_CHUNK).max(1);
        }
        2 + rows.saturating_sub(2 * edge).div_ceil(SCORE_ROWS_PER_CHUNK)
    }

    /// Doubles of workspace [`score`] needs.
    pub fn score_workspace_len(rows: usize, slots: usize, n_cand: usize, edge: usize) -> usize {
        slots * n_cand * chunks(rows, edge) * 3
    }

    /// Slots per block of `score_partials_vec` (kernels/score.cu `SCORE_SLOTS`).
    const SCORE_SLOTS: usize = 4;
    /// Threads per block of `score_partials_vec`.
    const SCORE_VEC_THREADS: u32 = 128;

    /// Launches the scoring: f64 through `score_partials_f64`; f32 with `kernel`, or with
    /// `score_partials` where `Vec4` cannot read the rows as float4s. Returns the f32 kernel
    /// that ran (`PerSlot` for f64).
    pub fn score(
        dev: &CudaDevice,
        a: &ScoreArgs,
        precision: Precision,
        kernel: ScoreKernel,
    ) -> Result<ScoreKernel> {
        if a.slots == 0 || a.n_cand == 0 {
            return Ok(kernel);
        }
        let kernel = match (precision, kernel) {
            (Precision::F64, _) => ScoreKernel::PerSlot,
            (_, ScoreKernel::Vec4) if !a.aligned => ScoreKernel::PerSlot,
            (_, k) => k,
        };
        let chunks = chunks(a.max_rows, a.edge);
        let groups = a.n_cand.div_ceil(SCORE_GROUP);
        let per_slot = (
            grid_dim(chunks, "score_partials")?,
            grid_dim_yz(a.slots, "score_partials slots")?,
            grid_dim_yz(groups, "score_partials candidates")?,
        );
        let (name, grid, threads) = match (precision, kernel) {
            (Precision::F64, _) => ("score_partials_f64", per_slot, 256),
            (_, ScoreKernel::PerSlot) => ("score_partials", per_slot, 256),
            (_, ScoreKernel::Vec4) => (
                "score_partials_vec",
                (
                    grid_dim(groups, "score_partials_vec candidates")?,
                    grid_dim_yz(chunks, "score_partials_vec chunks")?,
                    grid_dim_yz(a.slots.div_ceil(SCORE_SLOTS), "score_partials_vec slots")?,
                ),
                SCORE_VEC_THREADS,
            ),
        };
        let name = format!("{name}{}", a.elems.suffix());
        let name = name.as_str();
        let partials = function(dev, Module::Score, name)?;
        let n_cand = to_i32(a.n_cand, "candidates")?;
        let n_jobs = to_i32(a.n_jobs, "jobs")?;
        launch!(
            dev,
            partials,
            name,
            cfg(grid, threads, 0)?,
            [
                a.cand,
                n_cand,
                a.jobs,
                n_jobs,
                a.state_ptr,
                to_i32(a.n_states, "states")?,
                to_i32(a.cols, "cols")?,
                to_i32(a.slots, "slots")?,
                SCORE_ROWS_PER_CHUNK as i32,
                to_i32(a.edge, "edge")?,
                a.workspace,
            ]
        );
        let finish = function(dev, Module::Score, "score_finish")?;
        let pairs = a.slots * a.n_cand;
        let config = cfg(
            (grid_dim(pairs.div_ceil(256), "score_finish")?, 1, 1),
            256,
            0,
        )?;
        launch!(
            dev,
            finish,
            "score_finish",
            config,
            [
                a.workspace,
                to_i32(chunks, "chunks")?,
                to_i32(a.slots, "slots")?,
                n_cand,
                a.cand,
                a.jobs,
                n_jobs,
                to_i32(a.edge, "edge")?,
                a.out,
            ]
        );
        Ok(kernel)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::random_vec;
    use crate::score::{Pairing, View, score_all};

    fn case(
        rows: usize,
        cols: usize,
        slots: usize,
        ref_rows: usize,
        n_states: usize,
        seed: u64,
    ) -> (Tensor, Tensor) {
        let mut xv = random_vec(rows * (slots * cols + 3), seed);
        if xv.len() > 7 {
            xv[5] = f32::NAN; // a non-finite captured value is skipped
            xv[7] = f32::INFINITY;
            // and one in a middle row (an interior's, where there is one)
            let mid = xv.len() / 2 + 1;
            xv[mid] = f32::NEG_INFINITY;
        }
        let x = Tensor::from_vec(xv, (rows, slots * cols + 3), &Device::Cpu).unwrap();
        let refs = Tensor::from_vec(
            random_vec(n_states * ref_rows * (cols + 2), seed + 1),
            (n_states, ref_rows, cols + 2),
            &Device::Cpu,
        )
        .unwrap();
        (x, refs)
    }

    fn candidates(n_states: usize) -> Vec<(usize, isize)> {
        (0..n_states)
            .flat_map(|q| [(q, 0), (q, 1), (q, -1), (q, -40)])
            .collect()
    }

    #[test]
    fn reference_matches_score_all() {
        let (rows, cols, slots, ref_rows, n_states) = (37, 24, 3, 38, 5);
        let (x, refs) = case(rows, cols, slots, ref_rows, n_states, 1);
        let cands = candidates(n_states);
        let got = reference_of(
            &x.narrow(1, 1, slots * cols).unwrap(),
            slots,
            cols,
            &refs,
            &cands,
        );
        let xv = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let rv = refs.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let xview = View {
            data: &xv[1..],
            rows,
            stride: slots * cols + 3,
            col: 0,
            cols: slots * cols,
        };
        let per_state = ref_rows * (cols + 2);
        let pairings: Vec<Pairing> = cands
            .iter()
            .map(|&(q, shift)| Pairing {
                reference: View {
                    data: &rv[q * per_state..(q + 1) * per_state],
                    rows: ref_rows,
                    stride: cols + 2,
                    col: 0,
                    cols,
                },
                shift,
            })
            .collect();
        for slot in 0..slots {
            let want = score_all(xview.columns(slot * cols, cols), &pairings);
            for (j, w) in want.iter().enumerate() {
                let g = got[slot * cands.len() + j].score();
                // The same f64 arithmetic in the same order: exact.
                assert_eq!(
                    (
                        g.cosine.to_bits(),
                        g.rel_err.to_bits(),
                        g.norm_ratio.to_bits(),
                        g.rows
                    ),
                    (
                        w.cosine.to_bits(),
                        w.rel_err.to_bits(),
                        w.norm_ratio.to_bits(),
                        w.rows
                    ),
                    "slot {slot} candidate {j}"
                );
            }
        }
        assert_eq!(got[3].rows, 0, "a shift of -40 leaves no rows");
        assert!(score_slots(&x, slots, cols, &refs, &[(5, 0)]).is_err());
    }

    /// [`score_slots_ref`] on the buffers [`score_slots`] would read.
    fn reference_of(
        x: &Tensor,
        slots: usize,
        cols: usize,
        refs: &Tensor,
        cands: &[(usize, isize)],
    ) -> Vec<PairSums> {
        let x = x.to_device(&Device::Cpu).unwrap();
        let refs = refs.to_device(&Device::Cpu).unwrap();
        let (rows, _) = x.dims2().unwrap();
        let (n_states, ref_rows, ref_cols) = refs.dims3().unwrap();
        let xm = crate::kernels::Matrix::of(x.layout(), "x").unwrap();
        let (xs, _) = x.storage_and_layout();
        let xv = match &*xs {
            candle_core::Storage::Cpu(c) => xm
                .slice(c.as_slice::<f32>().unwrap(), "x")
                .unwrap()
                .to_vec(),
            _ => unreachable!(),
        };
        let shape = ScoreShape {
            rows,
            cols,
            slots,
            x_stride: xm.stride,
            n_states,
            ref_rows,
            ref_stride: ref_cols,
        };
        let rv = refs.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        score_slots_ref(&xv, &rv, &shape, cands)
    }

    /// f32 products summed per row (the CPU pass, the GPU's per-thread partials) against f64
    /// sums: a few f32 ulps of the partial sums' size. For the cross term that size is
    /// sqrt(xx * cc) (it may cancel to near 0), so the bound is relative to it: a cosine error
    /// of at most 1e-5.
    fn assert_sums_close(got: &[PairSums], want: &[PairSums]) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert_eq!(g.rows, w.rows, "pair {i}");
            let scale = (w.xx * w.cc).sqrt();
            for (a, b, size) in [(g.xx, w.xx, w.xx), (g.xc, w.xc, scale), (g.cc, w.cc, w.cc)] {
                assert!((a - b).abs() <= 1e-5 * (1.0 + size), "pair {i}: {a} vs {b}");
            }
        }
    }

    /// The CPU pass (`score_slots` on the CPU: the matrix-product form) against the scalar
    /// reference, over ragged shapes, shifts beyond the rows, non-finite captured values and
    /// more captured than reference rows.
    #[test]
    fn cpu_pass_matches_reference() {
        for &(rows, cols, slots, ref_rows, n_states) in &[
            (1, 1, 1, 1, 1),
            (37, 24, 3, 38, 5),
            (40, 9, 2, 38, 3),
            (45, 7, 2, 38, 2),
            (300, 1000, 4, 301, 9),
        ] {
            let (x, refs) = case(rows, cols, slots, ref_rows, n_states, 5);
            let cands = candidates(n_states);
            let xw = x.narrow(1, 2, slots * cols).unwrap();
            let got = score_slots(&xw, slots, cols, &refs, &cands).unwrap();
            let want = reference_of(&xw, slots, cols, &refs, &cands);
            assert_sums_close(&got, &want);
        }
    }

    /// Launches take every job once, in order, each within the grid (a job alone when it is
    /// larger than one).
    #[test]
    fn launches_cover_the_jobs_within_the_grid() {
        let cases: [Vec<usize>; 4] = [
            vec![],
            vec![3; 10],
            vec![4 * MAX_GROUPS - 4, 8, 5, 4 * MAX_GROUPS],
            vec![4 * MAX_GROUPS + 1, 1, 1],
        ];
        for counts in cases {
            let parts = launches(&counts);
            let flat: Vec<usize> = parts.iter().flat_map(|r| r.clone()).collect();
            assert_eq!(flat, (0..counts.len()).collect::<Vec<_>>(), "{counts:?}");
            for r in &parts {
                let groups: usize = counts[r.clone()].iter().map(|n| n.div_ceil(4)).sum();
                assert!(groups <= MAX_GROUPS || r.len() == 1, "{counts:?}: {r:?}");
            }
        }
        assert_eq!(launches(&[3; 10]).len(), 1);
        assert_eq!(
            launches(&[4 * MAX_GROUPS - 4, 8, 5, 4 * MAX_GROUPS]).len(),
            3
        );
    }

    /// Jobs of different rows, states and shifts scored together: each job's sums are its own
    /// alone, in f32 (the CPU pass) and f64 (the reference's arithmetic, bit for bit).
    #[test]
    fn jobs_match_each_job_alone() {
        jobs_against_each_alone(&Device::Cpu);
    }

    fn jobs_against_each_alone(device: &Device) {
        let (cols, slots) = (24, 3);
        let shapes = [(37, 38, 5), (9, 9, 2), (64, 64, 3), (1, 1, 1)];
        let cases: Vec<(Tensor, Tensor)> = shapes
            .iter()
            .enumerate()
            .map(|(i, &(rows, ref_rows, n))| {
                let (x, refs) = case(rows, cols, slots, ref_rows, n, 11 + i as u64);
                (
                    x.narrow(1, 1, slots * cols)
                        .unwrap()
                        .to_device(device)
                        .unwrap(),
                    refs.to_device(device).unwrap(),
                )
            })
            .collect();
        let states: Vec<Vec<Tensor>> = cases
            .iter()
            .map(|(_, r)| (0..r.dim(0).unwrap()).map(|q| r.get(q).unwrap()).collect())
            .collect();
        let jobs: Vec<Job> = cases
            .iter()
            .zip(&states)
            .map(|((x, _), st)| {
                Job::new(
                    x,
                    st.iter().collect(),
                    // Not a multiple of four: the next job's candidates start a new group.
                    candidates(st.len()).into_iter().skip(1).collect(),
                )
            })
            .collect();
        for precision in [Precision::F32, Precision::F64] {
            let got = score_jobs(&jobs, slots, cols, precision).unwrap();
            for (i, ((x, refs), job)) in cases.iter().zip(&jobs).enumerate() {
                let want = reference_of(x, slots, cols, refs, &job.candidates);
                match precision {
                    Precision::F32 => assert_sums_close(&got[i], &want),
                    Precision::F64 if device.is_cpu() => assert_eq!(got[i], want, "job {i}"),
                    Precision::F64 => {
                        // f64 products summed in another order: a few f64 ulps.
                        for (g, w) in got[i].iter().zip(&want) {
                            assert_eq!(g.rows, w.rows, "job {i}");
                            for (a, b) in [(g.xx, w.xx), (g.xc, w.xc), (g.cc, w.cc)] {
                                assert!((a - b).abs() <= 1e-12 * (1.0 + w.xx + w.cc), "job {i}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn bf16_values_score_as_their_widening() {
        bf16_against_widened(&Device::Cpu);
    }

    /// bf16 states (and bf16 slots against them) score exactly as the same values widened to
    /// f32: every kernel, both precisions, rows the vector kernel reads and rows it cannot
    /// (odd column windows), non-finite captured values among them.
    fn bf16_against_widened(device: &Device) {
        let (rows, cols, slots, ref_rows, n_states) = (70, 64, 5, 71, 4);
        let (x, refs) = case(rows, cols, slots, ref_rows, n_states, 29);
        let on = |t: Tensor| t.to_device(device).unwrap();
        let cands = candidates(n_states);
        for aligned in [false, true] {
            for x_bf16 in [false, true] {
                let x = if x_bf16 {
                    x.to_dtype(DType::BF16).unwrap()
                } else {
                    x.clone()
                };
                let refs = refs.to_dtype(DType::BF16).unwrap();
                // Odd column windows (read one value at a time), or contiguous rows.
                let (xs, rs) = if aligned {
                    let x = x.narrow(1, 0, slots * cols).unwrap().contiguous().unwrap();
                    (
                        on(x),
                        on(refs.narrow(2, 0, cols).unwrap().contiguous().unwrap()),
                    )
                } else {
                    (
                        on(x).narrow(1, 1, slots * cols).unwrap(),
                        on(refs).narrow(2, 1, cols).unwrap(),
                    )
                };
                let (xs32, rs32) = (
                    xs.to_dtype(DType::F32).unwrap(),
                    rs.to_dtype(DType::F32).unwrap(),
                );
                let st: Vec<Tensor> = (0..n_states).map(|q| rs.get(q).unwrap()).collect();
                let st32: Vec<Tensor> = (0..n_states).map(|q| rs32.get(q).unwrap()).collect();
                let (job, job32) = (
                    Job::new(&xs, st.iter().collect(), cands.clone()),
                    Job::new(&xs32, st32.iter().collect(), cands.clone()),
                );
                for precision in [Precision::F32, Precision::F64] {
                    for kernel in [ScoreKernel::PerSlot, ScoreKernel::Vec4] {
                        let what = format!(
                            "aligned {aligned}, x bf16 {x_bf16}, {precision:?}, {kernel:?}"
                        );
                        let (got, ran) = score_jobs_with(
                            std::slice::from_ref(&job),
                            slots,
                            cols,
                            precision,
                            kernel,
                            0,
                        )
                        .unwrap();
                        if !device.is_cpu() && precision == Precision::F32 {
                            let want = if aligned {
                                kernel
                            } else {
                                ScoreKernel::PerSlot
                            };
                            assert_eq!(ran, Some(want), "{what}");
                        }
                        // The widened copy is contiguous: the same kernel forced on it.
                        let (want, _) = score_jobs_with(
                            std::slice::from_ref(&job32),
                            slots,
                            cols,
                            precision,
                            ran.unwrap_or(kernel),
                            0,
                        )
                        .unwrap();
                        assert_eq!(got, want, "{what}");
                        assert!(got[0].iter().any(|p| p.xc != 0.0), "{what}");
                    }
                }
            }
        }
    }

    #[test]
    fn split_interior_is_the_sums_without_the_edge_rows() {
        split_against_edge_rows_skipped(&Device::Cpu);
    }

    /// [`score_jobs_split`]: its every-row sums are [`score_jobs`]'s, and its interior's are the
    /// sums of the same job with the edge rows' values all NaN (skipped, as a non-finite
    /// captured value is), the interior's row count the interior rows paired: f32 and bf16, both
    /// kernels, a middle row's non-finite value among them, jobs of different rows in one launch
    /// (one shorter than both edges: no interior).
    fn split_against_edge_rows_skipped(device: &Device) {
        let (cols, slots, edge) = (64, 5, 3);
        let shapes = [(37, 38, 3), (5, 5, 2), (300, 301, 2)];
        for bf16 in [false, true] {
            let dtype = if bf16 { DType::BF16 } else { DType::F32 };
            let mut xs = Vec::new();
            let mut masked = Vec::new();
            let mut states = Vec::new();
            for (i, &(rows, ref_rows, n)) in shapes.iter().enumerate() {
                let (x, refs) = case(rows, cols, slots, ref_rows, n, 41 + i as u64);
                let x = x.narrow(1, 0, slots * cols).unwrap().contiguous().unwrap();
                let refs = refs.narrow(2, 0, cols).unwrap().contiguous().unwrap();
                let mut values = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let width = slots * cols;
                for t in (0..edge.min(rows)).chain(rows.saturating_sub(edge)..rows) {
                    values[t * width..][..width].fill(f32::NAN);
                }
                let nan = Tensor::from_vec(values, (rows, width), &Device::Cpu).unwrap();
                let on = |t: &Tensor| t.to_dtype(dtype).unwrap().to_device(device).unwrap();
                xs.push(on(&x));
                masked.push(on(&nan));
                states.push(
                    (0..n)
                        .map(|q| on(&refs.get(q).unwrap()))
                        .collect::<Vec<_>>(),
                );
            }
            fn jobs_of<'a>(xs: &'a [Tensor], states: &'a [Vec<Tensor>]) -> Vec<Job<'a>> {
                xs.iter()
                    .zip(states)
                    .map(|(x, st)| Job::new(x, st.iter().collect(), candidates(st.len())))
                    .collect()
            }
            let (jobs, masked_jobs) = (jobs_of(&xs, &states), jobs_of(&masked, &states));
            for kernel in [ScoreKernel::PerSlot, ScoreKernel::Vec4] {
                let what = format!("bf16 {bf16}, {kernel:?}");
                let (split, ran) =
                    score_jobs_with(&jobs, slots, cols, Precision::F32, kernel, edge).unwrap();
                if !device.is_cpu() {
                    assert_eq!(ran, Some(kernel), "{what}");
                }
                let (full, _) =
                    score_jobs_with(&jobs, slots, cols, Precision::F32, kernel, 0).unwrap();
                let (skipped, _) =
                    score_jobs_with(&masked_jobs, slots, cols, Precision::F32, kernel, 0).unwrap();
                for (i, &(rows, ref_rows, _)) in shapes.iter().enumerate() {
                    let m = slots * jobs[i].candidates.len();
                    assert_eq!(split[i].len(), 2 * m, "{what}: job {i}");
                    let (every, inner) = split[i].split_at(m);
                    assert_sums_close(every, &full[i]);
                    // The interior's rows: t in edge..rows - edge with 0 <= t + shift < ref_rows.
                    let (lo, hi) = (
                        edge.min(rows),
                        rows.saturating_sub(edge).max(edge.min(rows)),
                    );
                    let want: Vec<PairSums> = skipped[i]
                        .iter()
                        .zip(0..)
                        .map(|(p, at)| {
                            let shift = jobs[i].candidates[at % jobs[i].candidates.len()].1;
                            let paired = (lo..hi)
                                .filter(|&t| (0..ref_rows as isize).contains(&(t as isize + shift)))
                                .count();
                            PairSums { rows: paired, ..*p }
                        })
                        .collect();
                    assert_sums_close(inner, &want);
                    assert!(
                        inner.iter().any(|p| p.xc != 0.0) || rows < 2 * edge,
                        "{what}"
                    );
                }
            }
        }
        assert!(score_jobs_split(&[], 1, 1, Precision::F32, 0).is_err());
    }

    /// States read as a job's slots (`Job::slot_states`, in any order, one of them twice)
    /// score as the same states' columns packed side by side into `x`, in one launch with a
    /// job of column slots; f32 and bf16 states, both f32 kernels and f64, with and without an
    /// edge. The reference is the scalar pass over the packed columns.
    #[test]
    fn states_read_as_slots_score_as_their_packed_columns() {
        states_as_slots_against_packed(&Device::Cpu);
    }

    fn states_as_slots_against_packed(device: &Device) {
        let (rows, cols, width, n_states) = (45, 24, 32, 5);
        let order = [3, 0, 3, 1];
        let slots = order.len();
        let refs = Tensor::from_vec(
            random_vec(n_states * rows * width, 41),
            (n_states, rows, width),
            &Device::Cpu,
        )
        .unwrap();
        let cands = candidates(n_states);
        let packed = |refs: &Tensor| {
            let parts: Vec<Tensor> = order
                .iter()
                .map(|&q| refs.get(q).unwrap().narrow(1, 0, cols).unwrap())
                .collect();
            Tensor::cat(&parts, 1).unwrap()
        };
        for dtype in [DType::F32, DType::BF16] {
            let refs = refs.to_dtype(dtype).unwrap();
            let on_device = refs.to_device(device).unwrap();
            let st: Vec<Tensor> = (0..n_states).map(|q| on_device.get(q).unwrap()).collect();
            let x = packed(&on_device).contiguous().unwrap();
            let as_slots = Job {
                x: &st[order[0]],
                states: st.iter().collect(),
                candidates: cands.clone(),
                slot_states: order.to_vec(),
                slots: None,
            };
            let columns = Job::new(&x, st.iter().collect(), cands[1..].to_vec());
            let want_x = packed(&refs.to_dtype(DType::F32).unwrap());
            let want_refs = refs.to_dtype(DType::F32).unwrap();
            for edge in [0, 4] {
                let narrowed = want_x.narrow(0, edge, rows - 2 * edge).unwrap();
                let moved: Vec<(usize, isize)> =
                    cands.iter().map(|&(q, d)| (q, d + edge as isize)).collect();
                let mut want = reference_of(&want_x, slots, cols, &want_refs, &cands);
                if edge > 0 {
                    want.extend(reference_of(&narrowed, slots, cols, &want_refs, &moved));
                }
                for precision in [Precision::F32, Precision::F64] {
                    for kernel in [ScoreKernel::PerSlot, ScoreKernel::Vec4] {
                        let jobs = [as_slots.clone(), columns.clone()];
                        let (got, ran) =
                            score_jobs_with(&jobs, slots, cols, precision, kernel, edge).unwrap();
                        let what = format!("{dtype:?} edge {edge} {precision:?} {kernel:?}");
                        if !device.is_cpu() && precision == Precision::F32 {
                            assert_eq!(ran, Some(kernel), "{what}: the kernel asked for");
                        }
                        assert_eq!(got[0].len(), want.len(), "{what}");
                        assert_sums_close(&got[0], &want);
                        assert_eq!(
                            got[1].len(),
                            slots * (cands.len() - 1) * (1 + (edge > 0) as usize),
                            "{what}"
                        );
                    }
                }
            }
        }
        // Slot states that are not the job's slots are refused.
        let st: Vec<Tensor> = (0..n_states).map(|q| refs.get(q).unwrap()).collect();
        let bad = Job {
            x: &st[0],
            states: st.iter().collect(),
            candidates: cands.clone(),
            slot_states: vec![0, n_states],
            slots: None,
        };
        assert!(score_jobs(&[bad], 2, cols, Precision::F32).is_err());
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn device_states_read_as_slots_score_as_their_packed_columns() {
        states_as_slots_against_packed(&crate::kernels::testing::gpu());
    }

    /// Jobs of 5, 3 and 1 slots of their own, and 2 read from states, in one launch of 5
    /// slots: each job's sums are its own alone, bit for bit (the same blocks sum them), in
    /// f32 and bf16, both precisions and kernels, with and without an edge. A job of more
    /// slots than its launch is refused.
    #[test]
    fn jobs_of_their_own_slot_counts_score_as_each_alone() {
        own_slot_counts_against_each_alone(&Device::Cpu);
    }

    fn own_slot_counts_against_each_alone(device: &Device) {
        let (cols, width, launch) = (24, 28, 5);
        // (rows, states, own slots); each x exactly its own slots wide, as the diff's asks are
        // (a job scored with the launch's count is refused), every row stride a multiple of
        // four (the vector kernel).
        let shapes = [(45, 3, 5), (40, 2, 3), (9, 2, 1)];
        for dtype in [DType::F32, DType::BF16] {
            let on = |v: Vec<f32>, shape: (usize, usize)| {
                Tensor::from_vec(v, shape, &Device::Cpu)
                    .and_then(|t| t.to_dtype(dtype))
                    .and_then(|t| t.to_device(device))
                    .unwrap()
            };
            let xs: Vec<Tensor> = shapes
                .iter()
                .enumerate()
                .map(|(i, &(rows, _, k))| {
                    let mut v = random_vec(rows * k * cols, 60 + i as u64);
                    v[(rows / 2) * k * cols + 3] = f32::NAN; // a middle row's
                    on(v, (rows, k * cols))
                })
                .collect();
            let states: Vec<Vec<Tensor>> = shapes
                .iter()
                .enumerate()
                .map(|(i, &(rows, n, _))| {
                    (0..n)
                        .map(|q| {
                            on(
                                random_vec(rows * width, 70 + 10 * i as u64 + q as u64),
                                (rows, width),
                            )
                        })
                        .collect()
                })
                .collect();
            let mut jobs: Vec<Job> = shapes
                .iter()
                .zip(xs.iter().zip(&states))
                .map(|(&(_, n, k), (x, st))| {
                    Job::new(x, st.iter().collect(), candidates(n)).with_slots(k)
                })
                .collect();
            // Two slots read from the first job's states.
            jobs.push(
                Job {
                    slot_states: vec![2, 0],
                    ..Job::new(&states[0][2], states[0].iter().collect(), candidates(3))
                }
                .with_slots(2),
            );
            for edge in [0, 3] {
                for precision in [Precision::F32, Precision::F64] {
                    for kernel in [ScoreKernel::PerSlot, ScoreKernel::Vec4] {
                        let what = format!("{dtype:?} edge {edge} {precision:?} {kernel:?}");
                        let (got, ran) =
                            score_jobs_with(&jobs, launch, cols, precision, kernel, edge).unwrap();
                        if !device.is_cpu() && precision == Precision::F32 {
                            assert_eq!(ran, Some(kernel), "{what}: the kernel asked for");
                        }
                        for (i, job) in jobs.iter().enumerate() {
                            let own = job.own_slots(launch);
                            let alone = Job {
                                slots: None,
                                ..job.clone()
                            };
                            let (want, _) =
                                score_jobs_with(&[alone], own, cols, precision, kernel, edge)
                                    .unwrap();
                            let halves = 1 + (edge > 0) as usize;
                            assert_eq!(
                                got[i].len(),
                                own * job.candidates.len() * halves,
                                "{what}: job {i}"
                            );
                            assert_eq!(got[i], want[0], "{what}: job {i}");
                        }
                    }
                }
            }
            let over = jobs[1].clone().with_slots(launch + 1);
            let err = score_jobs(&[over], launch, cols, Precision::F32).unwrap_err();
            assert!(
                err.to_string().contains("6 slots in a launch of 5"),
                "{err}"
            );
        }
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn device_jobs_of_their_own_slot_counts_score_as_each_alone() {
        own_slot_counts_against_each_alone(&crate::kernels::testing::gpu());
    }

    /// Every state's edge rows in one tensor, each state's head then tail: the rows of the
    /// states themselves, for whole 16-byte copies (the GPU's one launch) and ragged ones
    /// (joined narrows), bf16 and f32, states that are views into a larger tensor; mixed
    /// shapes are refused.
    #[test]
    fn edge_rows_all_are_each_states_head_and_tail() {
        edge_rows_against_states(&Device::Cpu);
    }

    fn edge_rows_against_states(device: &Device) {
        let edge = 8;
        for (rows, h, n) in [(40, 64, 3), (17, 7, 5), (16, 32, 1)] {
            let all =
                Tensor::from_vec(random_vec(n * rows * h, 53), (n, rows, h), &Device::Cpu).unwrap();
            for dtype in [DType::BF16, DType::F32] {
                let on = all.to_dtype(dtype).unwrap().to_device(device).unwrap();
                let states: Vec<Tensor> = (0..n).map(|q| on.get(q).unwrap()).collect();
                let got = edge_rows_all(&states.iter().collect::<Vec<_>>(), edge).unwrap();
                assert_eq!(got.dims(), [2 * edge * n, h], "{rows} {h} {dtype:?}");
                let got = got
                    .to_dtype(DType::F32)
                    .unwrap()
                    .to_device(&Device::Cpu)
                    .unwrap();
                let host = all.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
                for q in 0..n {
                    let state = host.get(q).unwrap();
                    for (e, row) in (0..edge).chain(rows - edge..rows).enumerate() {
                        let want = state.get(row).unwrap().to_vec1::<f32>().unwrap();
                        let have = got.get(2 * edge * q + e).unwrap().to_vec1::<f32>().unwrap();
                        assert!(want == have, "{rows} {h} {dtype:?}: state {q} edge row {e}");
                    }
                }
            }
        }
        let (a, b) = (
            Tensor::zeros((20, 8), DType::F32, device).unwrap(),
            Tensor::zeros((21, 8), DType::F32, device).unwrap(),
        );
        assert!(edge_rows_all(&[&a, &b], edge).is_err());
        assert!(edge_rows_all(&[], edge).is_err());
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn device_edge_rows_all_are_each_states_head_and_tail() {
        edge_rows_against_states(&crate::kernels::testing::gpu());
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn device_split_interior_is_the_sums_without_the_edge_rows() {
        split_against_edge_rows_skipped(&crate::kernels::testing::gpu());
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn device_bf16_values_score_as_their_widening() {
        bf16_against_widened(&crate::kernels::testing::gpu());
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn device_jobs_match_each_job_alone() {
        jobs_against_each_alone(&crate::kernels::testing::gpu());
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn device_matches_reference() {
        let gpu = crate::kernels::testing::gpu();
        // Tiny ragged, five slots (two slot batches of the float4 kernel), candidates not a
        // multiple of four, and a realistic diff: 3 slots of 4096 at T = 2048 against 33 states.
        // Each in two layouts: column windows at odd strides (the float4 kernel cannot read
        // them and hands over to the per-slot one) and contiguous rows of 16-byte multiples.
        for &(rows, cols, slots, ref_rows, n_states) in &[
            (1, 4, 1, 1, 1),
            (37, 24, 3, 38, 5),
            (70, 300, 5, 66, 3),
            (2048, 4096, 3, 2049, 33),
        ] {
            let (x, refs) = case(rows, cols, slots, ref_rows, n_states, 3);
            let mut cands = candidates(n_states);
            cands.pop();
            let windows = (
                x.narrow(1, 2, slots * cols).unwrap(),
                refs.narrow(2, 1, cols).unwrap(),
                false,
            );
            // Fresh buffers (a one-row window counts as contiguous and keeps its offset).
            let fresh = |t: &Tensor| {
                Tensor::from_vec(
                    t.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    t.shape(),
                    &Device::Cpu,
                )
                .unwrap()
            };
            let packed = (fresh(&windows.0), fresh(&windows.1), true);
            for (xw, rw, aligned) in [windows, packed] {
                let want = reference_of(&xw, slots, cols, &rw, &cands);
                let xg = xw.to_device(&gpu).unwrap();
                let rg = rw.to_device(&gpu).unwrap();
                let states: Vec<Tensor> = (0..n_states).map(|q| rg.get(q).unwrap()).collect();
                let job = Job::new(&xg, states.iter().collect(), cands.clone());
                for kernel in [ScoreKernel::PerSlot, ScoreKernel::Vec4] {
                    let (mut got, ran) = score_jobs_with(
                        std::slice::from_ref(&job),
                        slots,
                        cols,
                        Precision::F32,
                        kernel,
                        0,
                    )
                    .unwrap();
                    let expected = match kernel {
                        ScoreKernel::Vec4 if !aligned => ScoreKernel::PerSlot,
                        k => k,
                    };
                    assert_eq!(
                        ran,
                        Some(expected),
                        "rows {rows} slots {slots} aligned {aligned}"
                    );
                    assert_sums_close(&got.pop().unwrap(), &want);
                }
            }
        }
    }
}
