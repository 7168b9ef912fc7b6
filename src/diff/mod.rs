//! The diff engine: re-run the target on each captured sample's token ids, identify what every
//! slot of the captured tensor really is, and turn that into named findings against the spec
//! (and, given a draft and an engine, against what the inference side feeds).

pub mod dump_ref;
pub mod identify;
pub mod names;
pub mod online;
pub mod reference;
pub mod sglang_ref;

use crate::boundary::{Boundary, Convention, FinalNorm, format_list};
use crate::engine::Feed;
use crate::error::{Error, Result};
use crate::judge::{check_feed, classify};
use crate::readers::{Format, HostTensor, Sample, capture_files, read_capture_path};
use crate::report::{CaptureReport, CaptureSlot, Finding, FindingName, Report, ThreeWayRow};
use crate::score::View;
use crate::spec::Spec;
use crate::tolerance::CaptureTolerance;
use identify::{SlotId, State, identify_slot, identify_slots, no_residual_deltas};
use online::OnlineSample;
use reference::ReferenceSource;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What `diff` reads besides the reference.
pub struct DiffInput<'a> {
    pub spec: &'a Spec,
    pub captures: &'a [PathBuf],
    /// The inference side (what `run` would feed), for the three-way comparison.
    pub feed: Option<&'a Feed>,
    /// The target's `model_type`, for the feed's fix.
    pub arch: Option<&'a str>,
    pub batching: Batching,
}

/// How a reference that runs the target goes over the samples.
#[derive(Debug, Clone, Copy, Default)]
pub struct Batching {
    /// One forward per sample, every reference state of it held at once (the path a dump
    /// takes): to compare the batched path with, and for sequences it sends back.
    pub per_sample: bool,
    /// The bytes the samples of one pass through the model may hold (their captures and what
    /// their identification keeps); `None`: half the memory available on the reference's
    /// device when the diff starts. Samples past it wait for the next pass, which reads the
    /// model again.
    pub budget: Option<u64>,
}

/// Where the time went, for the benchmark.
#[derive(Debug, Default, Clone, Copy)]
pub struct DiffStats {
    pub samples: usize,
    /// Entries that hold no hidden states (a vocab mapping beside the data, say).
    pub skipped: usize,
    pub files: usize,
    pub read_seconds: f64,
    pub reference_seconds: f64,
    pub scoring_seconds: f64,
    /// The smallest margin between a matched boundary and its neighbours, over every slot.
    pub min_neighbour_margin: Option<f64>,
    /// Passes of the target over many samples at once (each reads the model once).
    pub passes: usize,
    /// Samples the batched identification could not decide exactly, run again alone.
    pub rerun: usize,
}

/// Findings of one kind collapse into one, with a count of the samples they stand for.
#[derive(Default)]
struct Collector {
    findings: BTreeMap<(FindingName, Option<usize>), Finding>,
}

impl Collector {
    fn add(&mut self, finding: Finding) {
        let key = (finding.name, finding.slot);
        self.findings
            .entry(key)
            .and_modify(|f| f.count = Some(f.count.unwrap_or(1) + 1))
            .or_insert(finding);
    }
}

/// The slots of a sample's capture: the tensor as read, `[rows, stride]`, slot i at column
/// `i * width`; its f32 values made when first viewed (a GPU's batched pass uploads a bf16
/// capture as stored and never views it on the host).
struct Slots {
    stored: HostTensor,
    data: std::sync::OnceLock<Vec<f32>>,
    rows: usize,
    stride: usize,
    width: usize,
    count: usize,
}

impl Slots {
    fn new(stored: &HostTensor, rows: usize, stride: usize, width: usize, count: usize) -> Slots {
        Slots {
            stored: stored.clone(),
            data: std::sync::OnceLock::new(),
            rows,
            stride,
            width,
            count,
        }
    }

    fn view(&self, i: usize) -> View<'_> {
        View {
            data: self.data.get_or_init(|| self.stored.to_f32_vec()),
            rows: self.rows,
            stride: self.stride,
            col: i * self.width,
            cols: self.width,
        }
    }
}

fn sample_label(sample: &Sample) -> String {
    sample.file.display().to_string()
}

/// Splits a sample's capture into slots: `aux` [S, k*H] (or a leading shard [S, k*H/tp]),
/// or vLLM's `layers` [S, n, H].
fn slots_of(sample: &Sample, hidden: usize, k_spec: usize) -> std::result::Result<Slots, String> {
    let as_2d = |t: &HostTensor| -> Option<(usize, usize)> {
        match t.dims() {
            [s, w] => Some((*s, *w)),
            [1, s, w] => Some((*s, *w)),
            _ => None,
        }
    };
    if let Some(aux) = &sample.aux {
        let (rows, w) = as_2d(aux).ok_or_else(|| {
            format!(
                "aux hidden states have shape {:?}, expected [S, k*H]",
                aux.dims()
            )
        })?;
        let (count, width) = if w % hidden == 0 {
            (w / hidden, hidden)
        } else if k_spec > 0 && w.is_multiple_of(k_spec) && hidden.is_multiple_of(w / k_spec) {
            (k_spec, w / k_spec)
        } else {
            return Err(format!(
                "aux width {w} is neither k x H (H = {hidden}) nor a shard of the spec's {k_spec} slots"
            ));
        };
        return Ok(Slots::new(aux, rows, w, width, count));
    }
    if let Some(layers) = &sample.layers {
        if let [_, _, h] = layers.dims()
            && *h != hidden
        {
            return Err(format!(
                "hidden_states rows are {h} wide, the target's hidden size is {hidden}"
            ));
        }
        let [rows, n, h] = layers.dims() else {
            return Err(format!(
                "hidden_states have shape {:?}, expected [T, n, H]",
                layers.dims()
            ));
        };
        return Ok(Slots::new(layers, *rows, n * h, *h, *n));
    }
    Err("no aux hidden states in this file (expected aux_hidden_state(s) or a vLLM hidden_states [T, n, H])".into())
}

/// Runs the diff and returns the report with per-file slot tables.
pub fn diff(input: &DiffInput, reference: &mut dyn ReferenceSource) -> Result<(Report, DiffStats)> {
    let spec = input.spec;
    let l = reference.num_layers();
    let hidden = reference.hidden_size();
    let mut report = Report::new("diff");
    report.fact("spec", format!("{} ({})", spec.name, spec.path.display()));
    report.fact("reference", reference.describe());
    for (key, value) in reference.facts() {
        report.fact(&key, value);
    }
    report.fact("spec_b", format_list(&spec.boundaries));
    check_spec_layers(spec, l)?;

    let mut junction_labels: Vec<String> = Vec::new();
    let batched = reference.runs_many() && !input.batching.per_sample;
    let budget = input.batching.budget.unwrap_or_else(|| {
        crate::memory::Budget::resolve(None, &reference.device())
            .map_or(DEFAULT_PASS_BYTES, |b| b.bytes / 2)
    });
    // A resident target costs nothing more per pass: smaller passes let the next one's files
    // be read while this one runs. A streamed one reads its layers again each pass.
    let budget = if reference.streams() {
        budget
    } else {
        budget.min(RESIDENT_PASS_BYTES)
    };
    // The states a pass's batch holds waiting to be scored, beside what its samples keep: a
    // quarter of the budget, at most FLUSH_BYTES.
    let flush = (budget / 4).min(online::FLUSH_BYTES);
    let budget = budget - flush;
    let mut judge = Judge {
        spec,
        hidden,
        l,
        flush,
        stats: DiffStats::default(),
        collector: Collector::default(),
        training: BTreeMap::new(),
        captures: Vec::new(),
    };
    let device = reference.device();
    let kept = Kept {
        state_bytes: reference.state_bytes(),
        on_device: !device.is_cpu(),
    };
    let ahead = ReadAhead::new(budget, hidden, l, kept);
    let prepare = |sample: &Sample| prepare_host(sample, spec, hidden, l, &device);
    let prepare: Option<&Prepare> = batched.then_some(&prepare);
    crate::progress::trace(|| "diff: the target is ready; reading the captures".into());
    let read = std::thread::scope(|scope| -> Result<ReadStats> {
        let reader = std::thread::Builder::new()
            .name("ec-captures".into())
            .spawn_scoped(scope, || read_units(input.captures, &ahead, prepare))
            .map_err(|e| Error::Device(format!("could not start the capture reader: {e}")))?;
        let _closed = ahead.closer();
        // One forward per sample: every sample after the first runs the same layers again.
        reference.keep_for_later(!batched);
        let mut pending = Pass::default();
        while let Some(read) = ahead.pop() {
            crate::model::phases::mark("diff: waiting for the captures", &device);
            let (read, bytes) = read?;
            if !batched {
                let (unit, _) = read;
                let results = judge.per_sample(&unit.1, reference)?;
                judge.record(&unit, results);
                continue;
            }
            pending.bytes += bytes;
            pending.units.push(read);
            if pending.bytes > budget {
                // More samples may follow: a streamed target keeps its layers for them.
                reference.keep_for_later(true);
                judge.pass(std::mem::take(&mut pending), reference)?;
            }
        }
        if !pending.units.is_empty() {
            reference.keep_for_later(false);
            judge.pass(pending, reference)?;
        }
        reader
            .join()
            .map_err(|_| Error::Device("the capture reader thread panicked".into()))
    })?;
    judge.stats.files += read.files;
    judge.stats.skipped += read.skipped;
    judge.stats.read_seconds += read.seconds;
    junction_labels.extend(read.junctions);
    let Judge {
        stats,
        collector,
        training,
        captures,
        ..
    } = judge;
    report.captures.extend(captures);
    if stats.passes > 0 {
        report.fact(
            "passes",
            format!(
                "{} pass(es) of the target over the samples, each reading its layers once{}",
                stats.passes,
                if stats.rerun > 0 {
                    format!(
                        "; {} sample(s) run again alone, the batched identification could not \
                         decide them exactly",
                        stats.rerun
                    )
                } else {
                    String::new()
                }
            ),
        );
    }
    if stats.samples == 0 {
        return Err(Error::Capture {
            path: describe_paths(input.captures).into(),
            message: format!(
                "no captured hidden states in {} file(s) (expected aux_hidden_state(s) or a vLLM hidden_states [T, n, H])",
                stats.files
            ),
        });
    }
    report.findings.extend(collector.findings.into_values());
    report.fact("samples", stats.samples.to_string());
    if !junction_labels.is_empty() {
        report.fact("junctions", junction_labels.join("; "));
    }
    if stats.skipped > 0 {
        report.fact(
            "skipped",
            format!("{} entries without hidden states", stats.skipped),
        );
    }

    if let Some(feed) = input.feed {
        let checked = check_feed(feed, spec, input.arch, l);
        report.slots.extend(checked.rows);
        report.findings.extend(checked.findings);
        let fed: Vec<Boundary> = feed.fed_slots().iter().map(|s| s.boundary).collect();
        let n = spec.boundaries.len().max(fed.len()).max(training.len());
        for slot in 0..n {
            let spec_b = spec.boundaries.get(slot).map(|b| b.index());
            let train_b = training
                .get(&slot)
                .and_then(|m| m.iter().max_by_key(|(_, c)| **c).map(|(b, _)| *b));
            let inf_b = fed.get(slot).map(|b| b.index());
            report.three_way.push(ThreeWayRow {
                slot,
                spec: spec_b,
                training: train_b,
                inference: inf_b,
                ok: spec_b.is_some() && spec_b == train_b && spec_b == inf_b,
            });
        }
        let trained: Vec<Boundary> = report
            .three_way
            .iter()
            .filter_map(|r| r.training)
            .map(Boundary)
            .collect();
        if trained.len() == report.three_way.len()
            && let Some((name, msg)) = classify(&fed, &trained, ("fed", "trained on"))
        {
            report.findings.push(
                Finding::error(name, format!("inference and training disagree: {msg}"))
                    .with_engine(&feed.engine_label()),
            );
        }
    }
    reference.report_resources(&mut report);
    Ok((report.finish(), stats))
}

/// Refuses a spec written for a target of another layer count than the reference's `l`.
pub fn check_spec_layers(spec: &Spec, l: usize) -> Result<()> {
    match spec.target.as_ref().and_then(|t| t.num_hidden_layers) {
        Some(sl) if sl != l => Err(Error::Spec {
            path: spec.path.clone(),
            message: format!(
                "the spec was written for a {sl}-layer target, the reference has {l} layers"
            ),
        }),
        _ => Ok(()),
    }
}

/// The capture files under `path`; none is a refusal.
fn list_captures(path: &Path) -> Result<Vec<PathBuf>> {
    let files = capture_files(path)?;
    if files.is_empty() {
        return Err(Error::Capture {
            path: path.to_path_buf(),
            message: "no capture files found".into(),
        });
    }
    Ok(files)
}

/// Refuses capture paths that are missing or hold no capture file, before anything is read.
pub fn check_captures(paths: &[PathBuf]) -> Result<()> {
    paths.iter().try_for_each(|p| list_captures(p).map(drop))
}

/// The samples of one file (or sglang junction), with the label the report gives it.
type Unit = (String, Vec<Sample>);

/// A unit as the reader hands it on: with its samples' host preparation when the diff
/// batches them, done on the reader's threads while the target runs the pass before.
type ReadUnit = (Unit, Option<Vec<Result<HostPrepared>>>);

/// A slot's identification with the finding (if any) that names it.
type Judged = (SlotId, Option<FindingName>);

/// One pass's worth of samples waiting for the target, and the bytes they hold.
#[derive(Default)]
struct Pass {
    units: Vec<ReadUnit>,
    bytes: u64,
}

/// A pass's samples on a resident target hold at most this much: each pass costs a resident
/// target nothing more, and the reader fills (and prepares) the next pass while this one runs.
/// Larger passes flush no faster (a flush's cost follows the states it scores) and read ahead
/// less: in run 37 (BENCHMARKS.md), 8 GiB made one pass of the 256 samples at T = 128 and
/// 0.83x the forward-only rate, where passes of 2 GiB kept reading beside the forwards (1.10x).
const RESIDENT_PASS_BYTES: u64 = 2 << 30;

/// What reading the captures cost, and the sglang junctions it found.
#[derive(Default)]
struct ReadStats {
    files: usize,
    skipped: usize,
    seconds: f64,
    junctions: Vec<String>,
}

/// Capture files read (and their samples prepared) at once at most, each on its own thread:
/// enough to keep a GPU's diff fed from the page cache (run 37: eight threads read and
/// prepared 256 8B-shape samples at T = 2048 in 10.3 s, more than the 12 s of forwards could
/// hide), few enough that what waits beyond the read-ahead's budget stays small.
const READ_AT_ONCE: usize = 16;

/// A sample's host preparation for a batched pass ([`prepare_host`]), on any thread.
type Prepare<'a> = dyn Fn(&Sample) -> Result<HostPrepared> + Sync + 'a;

/// Reads every capture path's units in order into `ahead` (on the reader thread), until they
/// are all read or the diff stops taking them; each file's samples prepared by `prepare` on
/// the thread that read it (the sglang junctions are left to their pass).
fn read_units(captures: &[PathBuf], ahead: &ReadAhead, prepare: Option<&Prepare>) -> ReadStats {
    let mut stats = ReadStats::default();
    let mut read = || -> Result<()> {
        for path in captures {
            let files = list_captures(path)?;
            // sglang's dumper writes a file per tensor: its junction dumps are regrouped into
            // one sample per pass and junction; the rest of its files hold no capture.
            let (sglang, files): (Vec<PathBuf>, Vec<PathBuf>) = files
                .into_iter()
                .partition(|f| crate::readers::sglang::is_sglang_dump(f));
            let mut units: Vec<Unit> = Vec::new();
            if !sglang.is_empty() {
                let start = Instant::now();
                let junctions = sglang_ref::junction_samples(&sglang)?;
                stats.seconds += start.elapsed().as_secs_f64();
                stats.files += sglang.len();
                if junctions.is_empty() {
                    stats.skipped += sglang.len();
                }
                for j in junctions {
                    stats.junctions.push(j.label.clone());
                    units.push((j.label, vec![j.sample]));
                }
            }
            for unit in units {
                if !ahead.push(Ok((unit, None))) {
                    return Ok(());
                }
            }
            // A few files at a time, each on its own thread (parsing and widening a large
            // capture is CPU work), handed on in order; the first failure in file order ends
            // the read, as one file at a time would.
            let at_once = rayon::current_num_threads().clamp(1, READ_AT_ONCE);
            for chunk in files.chunks(at_once) {
                let start = Instant::now();
                let read: Vec<Result<(Vec<Sample>, _)>> = {
                    use rayon::prelude::*;
                    chunk
                        .par_iter()
                        .map(|f| {
                            let samples = read_capture_path(f)?;
                            let host = prepare.map(|p| samples.par_iter().map(p).collect());
                            Ok((samples, host))
                        })
                        .collect()
                };
                stats.seconds += start.elapsed().as_secs_f64();
                for (file, read) in chunk.iter().zip(read) {
                    let (samples, host) = read?;
                    stats.files += 1;
                    if !ahead.push(Ok(((file.display().to_string(), samples), host))) {
                        return Ok(());
                    }
                }
            }
        }
        Ok(())
    };
    if let Err(e) = read() {
        ahead.push(Err(e));
    }
    ahead.finish();
    stats
}

/// Each unit's host work: the reader's where it did it, else `prepare` of each of its
/// samples, in parallel. A unit the reader prepared queues nothing on rayon's global pool:
/// while the reader reads ahead its file jobs hold that pool, and a job queued behind them
/// waits for them (on the H100, 29 ms a pass at T = 2,048 where every unit was the reader's,
/// 0.2 ms a pass now: BENCHMARKS.md, runs 57 and 59).
fn host_work<S: Sync, T: Send>(
    units: &[(String, Vec<S>)],
    host: Vec<Option<Vec<T>>>,
    prepare: impl Fn(&S) -> T + Sync,
) -> Vec<Vec<T>> {
    use rayon::prelude::*;
    units
        .iter()
        .zip(host)
        .map(|((_, samples), host)| {
            host.unwrap_or_else(|| samples.par_iter().map(&prepare).collect())
        })
        .collect()
}

/// The units read ahead of the diff, held up to a byte budget ([`unit_bytes`]): the reader
/// waits while they exceed it (one unit always fits), the diff while none is there.
struct ReadAhead {
    state: std::sync::Mutex<AheadState>,
    changed: std::sync::Condvar,
    budget: u64,
    /// The hidden size, layer count and keeping [`unit_bytes`] sizes a unit by.
    hidden: usize,
    l: usize,
    kept: Kept,
}

#[derive(Default)]
struct AheadState {
    queue: std::collections::VecDeque<(Result<ReadUnit>, u64)>,
    bytes: u64,
    /// The reader has read everything.
    done: bool,
    /// The diff stopped taking units.
    closed: bool,
}

impl ReadAhead {
    fn new(budget: u64, hidden: usize, l: usize, kept: Kept) -> ReadAhead {
        ReadAhead {
            state: Default::default(),
            changed: Default::default(),
            budget,
            hidden,
            l,
            kept,
        }
    }

    /// Queues a unit; false once the diff has stopped taking them.
    fn push(&self, unit: Result<ReadUnit>) -> bool {
        let bytes = unit.as_ref().map_or(0, |((_, samples), _)| {
            unit_bytes(samples, self.hidden, self.l, self.kept)
        });
        let Ok(mut s) = self.state.lock() else {
            return false;
        };
        while !s.closed && s.bytes > 0 && s.bytes + bytes > self.budget {
            s = match self.changed.wait(s) {
                Ok(s) => s,
                Err(_) => return false,
            };
        }
        if s.closed {
            return false;
        }
        s.bytes += bytes;
        s.queue.push_back((unit, bytes));
        self.changed.notify_all();
        true
    }

    /// The next unit and its bytes, waiting for the reader; `None` once all were taken.
    fn pop(&self) -> Option<Result<(ReadUnit, u64)>> {
        let mut s = self.state.lock().ok()?;
        loop {
            if let Some((unit, bytes)) = s.queue.pop_front() {
                s.bytes -= bytes;
                self.changed.notify_all();
                return Some(unit.map(|u| (u, bytes)));
            }
            if s.done {
                return None;
            }
            s = self.changed.wait(s).ok()?;
        }
    }

    fn finish(&self) {
        if let Ok(mut s) = self.state.lock() {
            s.done = true;
        }
        self.changed.notify_all();
    }

    /// Stops the reader when dropped (the diff returned, or failed).
    fn closer(&self) -> impl Drop + '_ {
        struct Closer<'a>(&'a ReadAhead);
        impl Drop for Closer<'_> {
            fn drop(&mut self) {
                if let Ok(mut s) = self.0.state.lock() {
                    s.closed = true;
                }
                self.0.changed.notify_all();
            }
        }
        Closer(self)
    }
}

/// When the memory available cannot be read: a pass's samples may hold this much.
const DEFAULT_PASS_BYTES: u64 = 4 << 30;

/// Where and how the batched identification keeps a pass's samples: the bytes of a kept
/// state's value (2 where a GPU's bf16 forward makes them, else 4), and whether that is a
/// device's memory (the budget is then of the device's memory alone).
#[derive(Clone, Copy)]
struct Kept {
    state_bytes: u64,
    on_device: bool,
}

/// What a unit's samples hold in the memory the budget is of: what their identification
/// keeps (every captured slot, in bf16 where the capture and the kept states are bf16, else
/// f32; each slot's best candidate's state, the ring of states made last, each state's edge
/// rows, in the states' type), and on the CPU also the captures stored and widened to f32.
fn unit_bytes(samples: &[Sample], hidden: usize, l: usize, kept: Kept) -> u64 {
    samples
        .iter()
        .map(|s| {
            let captures = [&s.aux, &s.layers, &s.final_hidden];
            let captured: u64 = captures
                .iter()
                .filter_map(|t| t.as_ref())
                .map(|t| t.numel() as u64)
                .sum();
            let bf16 = captures
                .iter()
                .filter_map(|t| t.as_ref())
                .all(|t| t.dtype == crate::readers::DType::BF16);
            let slot_bytes = if kept.on_device && kept.state_bytes == 2 && bf16 {
                2
            } else {
                4
            };
            let rows = s.token_ids.as_ref().map_or(0, Vec::len) as u64;
            let (h, l) = (hidden as u64, l as u64);
            // A best candidate's state per slot, and the ring.
            let slots = captured / (rows * h).max(1);
            let states = (slots + online::RING as u64) * rows * h;
            let edges = 2 * online::EDGE as u64 * h * (2 * l + 2);
            let host = if kept.on_device { 0 } else { 4 * 2 * captured };
            host + slot_bytes * captured + kept.state_bytes * (states + edges)
        })
        .sum()
}

/// The diff's running state: every sample judged against the spec, what each slot held, the
/// findings collected.
struct Judge<'a> {
    spec: &'a Spec,
    hidden: usize,
    l: usize,
    /// Bytes of states a pass's batch holds waiting at most ([`online::Batch::new`]).
    flush: u64,
    stats: DiffStats,
    collector: Collector,
    /// Per slot: how often each boundary was found, for the three-way table.
    training: BTreeMap<usize, BTreeMap<usize, usize>>,
    captures: Vec<CaptureReport>,
}

/// A sample ready for its pass: its slots, its tokens, its identification as it goes.
struct Prepared {
    slots: Slots,
    online: OnlineSample,
    aux: usize,
    /// The group of the training target the file carries (SpecForge, Model-Optimizer).
    target: Option<usize>,
}

impl Judge<'_> {
    /// Each sample of a unit against the reference states of its own forward.
    fn per_sample(
        &mut self,
        samples: &[Sample],
        reference: &mut dyn ReferenceSource,
    ) -> Result<Vec<Option<Vec<Judged>>>> {
        samples
            .iter()
            .map(|sample| {
                if !has_states(sample) {
                    return Ok(None);
                }
                let Some((slots, tokens)) = self.slots(sample)? else {
                    return Ok(Some(Vec::new()));
                };
                let found = self.identify_alone(sample, &slots, tokens, reference)?;
                Ok(Some(self.judge(sample, found)))
            })
            .collect()
    }

    /// One pass of the target over every sample of `pass`, each identified as its states are
    /// made; a sample the batched identification cannot decide exactly runs again alone.
    fn pass(&mut self, pass: Pass, reference: &mut dyn ReferenceSource) -> Result<()> {
        let device = reference.device();
        // The samples' host work (widening, non-finite counts, packing), done by the reader
        // where it could, else here in parallel; then their findings, token checks and
        // uploads in order on this thread.
        let (spec, hidden, l) = (self.spec, self.hidden, self.l);
        let (units, host): (Vec<Unit>, Vec<_>) = pass.units.into_iter().unzip();
        let host = host_work(&units, host, |sample| {
            prepare_host(sample, spec, hidden, l, &device)
        });
        crate::model::phases::mark("diff: the reader's preparations", &device);
        let mut prepared: Vec<Vec<Option<Prepared>>> = Vec::with_capacity(units.len());
        for ((_, samples), host) in units.iter().zip(host) {
            let mut unit = Vec::with_capacity(samples.len());
            for (sample, host) in samples.iter().zip(host) {
                let ready = if has_states(sample) {
                    self.prepared(sample, host?, reference)?
                } else {
                    None
                };
                unit.push(ready);
            }
            prepared.push(unit);
        }
        // Each prepared sample's tokens beside its identification (a prepared sample has
        // tokens: `sample_slots` checked them), in the order the sink numbers them.
        let (tokens, online): (Vec<&[i64]>, Vec<&mut OnlineSample>) = units
            .iter()
            .zip(prepared.iter_mut())
            .flat_map(|((_, samples), ready)| samples.iter().zip(ready.iter_mut()))
            .filter_map(|(s, r)| Some((s.token_ids.as_deref()?, &mut r.as_mut()?.online)))
            .unzip();
        crate::model::phases::mark("diff: preparing samples", &device);
        let start = Instant::now();
        let mut scoring = 0.0;
        let pass_no = self.stats.passes + 1;
        crate::progress::trace(|| format!("diff pass {pass_no}: {} sample(s)", tokens.len()));
        if !tokens.is_empty() {
            // Every sample of the pass scored together: a flush scores all their waiting
            // states at once, and the best candidates are rescored together at the end.
            let mut batch = online::Batch::new(online, self.flush);
            let states = if reference.state_bytes() == 2 {
                candle_core::DType::BF16
            } else {
                candle_core::DType::F32
            };
            batch.upload_ahead(states)?;
            crate::model::phases::mark("diff: asking for the slots' copies", &device);
            crate::progress::trace(|| format!("diff pass {pass_no}: the slots' copies asked for"));
            reference.run_many(&tokens, &mut |s, what, t| {
                let at = Instant::now();
                let taken = batch.take(s, what, t);
                scoring += at.elapsed().as_secs_f64();
                taken
            })?;
            let at = Instant::now();
            batch.finish()?;
            scoring += at.elapsed().as_secs_f64();
            self.stats.passes += 1;
        }
        self.stats.reference_seconds += start.elapsed().as_secs_f64() - scoring;
        self.stats.scoring_seconds += scoring;
        crate::progress::trace(|| {
            format!(
                "diff pass {pass_no}: run and scored in {:.2} s ({scoring:.2} s scoring)",
                start.elapsed().as_secs_f64()
            )
        });
        let mut spent = Vec::with_capacity(units.len());
        for (unit, ready) in units.into_iter().zip(prepared) {
            let mut results = Vec::with_capacity(unit.1.len());
            for (sample, ready) in unit.1.iter().zip(ready) {
                results.push(if !has_states(sample) {
                    None
                } else if let Some(ready) = ready {
                    Some(self.finish(sample, ready, reference)?)
                } else {
                    Some(Vec::new())
                });
                crate::model::phases::mark("diff: deciding and judging", &device);
            }
            self.record(&unit, results);
            spent.push(unit);
        }
        if !device.is_cpu() {
            free_elsewhere(spent);
        }
        crate::model::phases::mark("diff: recording", &device);
        Ok(())
    }

    /// A sample against the reference states of its own forward (or a dump's).
    fn identify_alone(
        &mut self,
        sample: &Sample,
        slots: &Slots,
        tokens: &[i64],
        reference: &mut dyn ReferenceSource,
    ) -> Result<Identified> {
        let (spec, hidden, l) = (self.spec, self.hidden, self.l);
        identify(
            sample,
            slots,
            tokens,
            reference,
            spec,
            hidden,
            l,
            &mut self.stats,
        )
    }

    /// A sample's host preparation with its findings collected and its tokens checked
    /// against the target; `None` when its slots do not fit the spec and the hidden size.
    fn prepared(
        &mut self,
        sample: &Sample,
        (ready, findings): HostPrepared,
        reference: &dyn ReferenceSource,
    ) -> Result<Option<Prepared>> {
        self.collect(sample, findings);
        let Some(ready) = ready else {
            return Ok(None);
        };
        let tokens = sample.token_ids.as_deref().unwrap_or_default();
        reference.check_tokens(tokens).map_err(|e| Error::Capture {
            path: sample.file.clone(),
            message: format!("sample {}: {e}", sample.index),
        })?;
        Ok(Some(ready))
    }

    /// The findings of a sample whose pass is done: its batched identification, else (when
    /// that could not decide exactly) a forward of its own.
    fn finish(
        &mut self,
        sample: &Sample,
        mut ready: Prepared,
        reference: &mut dyn ReferenceSource,
    ) -> Result<Vec<Judged>> {
        let start = Instant::now();
        let aux = ready.online.finish(ready.aux, 0)?;
        let target = ready
            .target
            .map(|g| ready.online.finish(g, ready.slots.count))
            .transpose()?;
        self.stats.scoring_seconds += start.elapsed().as_secs_f64();
        let found = match (aux, target) {
            (Some(mut ids), target @ (None | Some(Some(_)))) => {
                let final_id = target.flatten().and_then(|mut v| v.pop());
                let vllm_last = vllm_target(sample, self.spec, self.l, &mut ids);
                Identified {
                    target: training_target(sample, vllm_last, final_id),
                    ids,
                    sides_known: true,
                }
            }
            _ => {
                self.stats.rerun += 1;
                let tokens = sample.token_ids.as_deref().unwrap_or_default();
                self.identify_alone(sample, &ready.slots, tokens, reference)?
            }
        };
        Ok(self.judge(sample, found))
    }

    /// A sample's slots and token ids (shape findings collected).
    fn slots<'s>(&mut self, sample: &'s Sample) -> Result<Option<(Slots, &'s [i64])>> {
        let mut findings = Vec::new();
        let slots = sample_slots(sample, self.spec, self.hidden, |f| findings.push(f));
        self.collect(sample, findings);
        slots
    }

    /// Findings about `sample`'s slots, collected with its file and index.
    fn collect(&mut self, sample: &Sample, findings: Vec<Finding>) {
        let label = sample_label(sample);
        for f in findings {
            self.collector
                .add(f.with_file(label.clone()).with_sample(sample.index));
        }
    }

    /// Every slot's identification with the finding (if any) that names it, and the sample's
    /// findings collected.
    fn judge(&mut self, sample: &Sample, found: Identified) -> Vec<Judged> {
        let (spec, l, hidden) = (self.spec, self.l, self.hidden);
        let label = sample_label(sample);
        let at = |f: Finding| f.with_file(label.clone()).with_sample(sample.index);
        let mut pending = slot_findings(&found.ids, spec, l, hidden, &mut self.stats);
        let shifted = pending.iter().any(|f| f.name == FindingName::TokenShift);
        pending.extend(layout_findings(&found.ids, spec));
        if let Some(t) = &found.target {
            // Both sides of the final norm must be in the reference to tell them apart (a vLLM
            // all-layer dump has only the pre-norm one).
            pending.extend(check_target(t, l, found.sides_known, shifted));
        }
        for f in pending {
            self.collector.add(at(f));
        }
        let expected = |slot: usize| spec.boundaries.get(slot).copied();
        let statuses: Vec<Option<FindingName>> = found
            .ids
            .iter()
            .map(|id| slot_status(id, expected(id.slot), spec.final_norm, l))
            .collect();
        found.ids.into_iter().zip(statuses).collect()
    }

    /// A unit's slot table (the worst sample per slot) and the boundaries its slots held.
    /// `results`: per sample, `None` for an entry without hidden states.
    fn record(&mut self, (label, samples): &Unit, results: Vec<Option<Vec<Judged>>>) {
        let spec = self.spec;
        let mut worst: BTreeMap<usize, Judged> = BTreeMap::new();
        let mut format = String::new();
        for (sample, ids) in samples.iter().zip(results) {
            // Files beside the data that hold no hidden states (SpecForge's vocab_mapping.pt
            // with d2t/t2d, say) are skipped, not judged.
            let Some(ids) = ids else {
                self.stats.skipped += 1;
                continue;
            };
            format = sample.format.name().to_string();
            self.stats.samples += 1;
            for (id, status) in ids {
                if let Some(found) = id.found {
                    *self
                        .training
                        .entry(id.slot)
                        .or_default()
                        .entry(found.boundary)
                        .or_default() += 1;
                }
                let keep = worst
                    .get(&id.slot)
                    .is_none_or(|(w, _)| id.score.cosine < w.score.cosine);
                if keep {
                    worst.insert(id.slot, (id, status));
                }
            }
        }
        if worst.is_empty() {
            return;
        }
        self.captures.push(CaptureReport {
            file: label.clone(),
            format,
            samples: samples.len(),
            slots: worst
                .into_values()
                .map(|(id, status)| CaptureSlot {
                    slot: id.slot,
                    expected_boundary: spec.boundaries.get(id.slot).map(|b| b.index()),
                    found_boundary: id.found.map(|c| c.boundary),
                    state: id.best.state.describe(),
                    cosine: id.score.cosine,
                    rel_err: id.score.rel_err,
                    norm_ratio: id.score.norm_ratio,
                    margin: id.margin,
                    status: status.map_or("ok".to_string(), |n| n.as_str().to_string()),
                })
                .collect(),
        });
    }
}

/// Drops a pass's samples (their captures as read: host memory only) on a thread of its own,
/// so that the thread running the passes goes on to the next: freeing a T = 2,048 8B-shape
/// sample's 67 MB took 6.3 ms on the development machine (`EAGLE_CHECK_BENCH_PREPARE=16 cargo
/// bench --bench diff`), about 1.6 s of a 256-sample diff (run 38 counted 2.0 s of deciding
/// and judging on the main thread). Only where the budget is a device's: on the CPU the
/// samples count against the host memory the next pass reads into. Dropped here when no
/// thread can be started.
fn free_elsewhere(spent: Vec<Unit>) {
    let _ = std::thread::Builder::new()
        .name("ec-free".into())
        .spawn(move || drop(spent));
}

/// Whether an entry holds hidden states (SpecForge's vocab_mapping.pt, beside the data, does
/// not).
fn has_states(sample: &Sample) -> bool {
    sample.aux.is_some() || sample.layers.is_some()
}

/// The tolerance of the sample's capture dtype.
fn capture_tolerance(sample: &Sample) -> CaptureTolerance {
    let dtype = sample
        .aux
        .as_ref()
        .or(sample.layers.as_ref())
        .map(|t| t.dtype);
    CaptureTolerance::for_dtype(dtype.unwrap_or(crate::readers::DType::F32))
}

/// The training target a SpecForge or Model-Optimizer sample carries as its own tensor, when
/// it is `[S, H]` (or `[1, S, H]`): the tensor as read and its rows.
fn training_stored(sample: &Sample, hidden: usize) -> Option<(&HostTensor, usize)> {
    if !matches!(sample.format, Format::SpecForge | Format::ModelOpt) {
        return None;
    }
    let t = sample.final_hidden.as_ref()?;
    match t.dims() {
        [s, h] | [1, s, h] if *h == hidden => Some((t, *s)),
        _ => None,
    }
}

/// [`training_stored`]'s values in f32.
fn training_tensor(sample: &Sample, hidden: usize) -> Option<(Vec<f32>, usize)> {
    training_stored(sample, hidden).map(|(t, rows)| (t.to_f32_vec(), rows))
}

/// A sample prepared on the host, and the findings its slots gave.
type HostPrepared = (Option<Prepared>, Vec<Finding>);

/// A sample's slots and its identification, set up before its pass on any thread (no device
/// call: the slots are uploaded by its first state); `None` (after a finding says why) when
/// its slots do not fit the spec and the hidden size.
fn prepare_host(
    sample: &Sample,
    spec: &Spec,
    hidden: usize,
    l: usize,
    device: &candle_core::Device,
) -> Result<HostPrepared> {
    let mut findings = Vec::new();
    if !has_states(sample) {
        return Ok((None, findings));
    }
    let Some((slots, tokens)) = sample_slots(sample, spec, hidden, |f| findings.push(f))? else {
        return Ok((None, findings));
    };
    let mut online = OnlineSample::new(l, hidden, tokens.len(), capture_tolerance(sample), device);
    let aux = online.group_stored(
        &slots.stored,
        slots.rows,
        slots.stride,
        slots.width,
        slots.count,
    )?;
    let target = training_stored(sample, hidden)
        .map(|(t, rows)| online.group_stored(t, rows, hidden, hidden, 1))
        .transpose()?;
    let ready = Prepared {
        slots,
        online,
        aux,
        target,
    };
    Ok((Some(ready), findings))
}

/// A sample's slots and token ids, checked against each other: `None` (after `shape_finding`
/// says why) when the slots do not fit the spec's count and the hidden size.
fn sample_slots<'s>(
    sample: &'s Sample,
    spec: &Spec,
    hidden: usize,
    mut shape_finding: impl FnMut(Finding),
) -> Result<Option<(Slots, &'s [i64])>> {
    let tokens = sample.token_ids.as_ref().ok_or_else(|| Error::Capture {
        path: sample.file.clone(),
        message: format!(
            "sample {} has no token ids: cannot re-run the target",
            sample.index
        ),
    })?;
    let slots = match slots_of(sample, hidden, spec.boundaries.len()) {
        Ok(s) => s,
        Err(msg) => {
            shape_finding(Finding::error(FindingName::Shape, msg));
            return Ok(None);
        }
    };
    // Rows and ids must pair one to one: scoring them anyway would report every slot as
    // unidentified, blaming the layout for what is a broken file.
    if slots.rows != tokens.len() {
        return Err(Error::Capture {
            path: sample.file.clone(),
            message: format!(
                "sample {}: {} token ids but {} rows of hidden states; they must pair one to one",
                sample.index,
                tokens.len(),
                slots.rows
            ),
        });
    }
    Ok(Some((slots, tokens)))
}

/// What one sample's slots were found to be.
struct Identified {
    ids: Vec<SlotId>,
    /// The training target the sample carries (its own tensor, or vLLM's last slot).
    target: Option<TrainingTarget>,
    /// The reference held both sides of the final norm (a vLLM all-layer dump has only the
    /// pre-norm one): only then can the training target's side be judged.
    sides_known: bool,
}

/// The reference states for the sample's tokens (a forward of its own, or a dump's), and
/// every slot scored against them.
#[allow(clippy::too_many_arguments)]
fn identify(
    sample: &Sample,
    slots: &Slots,
    tokens: &[i64],
    reference: &mut dyn ReferenceSource,
    spec: &Spec,
    hidden: usize,
    l: usize,
    stats: &mut DiffStats,
) -> Result<Identified> {
    let tol = capture_tolerance(sample);
    let start = Instant::now();
    let refs = reference.states(tokens).map_err(|e| Error::Capture {
        path: sample.file.clone(),
        message: format!("sample {}: {e}", sample.index),
    })?;
    stats.reference_seconds += start.elapsed().as_secs_f64();
    let start = Instant::now();
    let deltas = no_residual_deltas(&refs);
    let device = reference.device();
    let views: Vec<View> = (0..slots.count).map(|i| slots.view(i)).collect();
    let mut ids: Vec<SlotId> = identify_slots(&views, &refs, &deltas, &tol, &device);
    let vllm_last = vllm_target(sample, spec, l, &mut ids);
    let final_id = training_tensor(sample, hidden).map(|(data, rows)| {
        identify_slot(
            slots.count,
            View::full(&data, rows, hidden),
            &refs,
            &deltas,
            &tol,
        )
    });
    let target = training_target(sample, vllm_last, final_id);
    stats.scoring_seconds += start.elapsed().as_secs_f64();
    let sides_known =
        refs.boundaries.get(l).is_some_and(Option::is_some) && refs.final_pre_norm.is_some();
    Ok(Identified {
        ids,
        target,
        sides_known,
    })
}

/// vLLM extract_hidden_states files end with the state after the last layer when the ids
/// asked for L (speculators appends it by default, Model-Optimizer's vLLM dump always): the
/// training target, not an fc input. One slot more than the spec, holding b = L, is that: it
/// leaves `ids` and is returned.
fn vllm_target(sample: &Sample, spec: &Spec, l: usize, ids: &mut Vec<SlotId>) -> Option<SlotId> {
    let last_is_l = ids
        .last()
        .and_then(|id| id.found)
        .is_some_and(|c| c.boundary == l);
    if sample.format == Format::Vllm && ids.len() == spec.boundaries.len() + 1 && last_is_l {
        ids.pop()
    } else {
        None
    }
}

/// `f`, naming `slot` when it is one slot's.
fn on_slot(slot: Option<usize>, f: Finding) -> Finding {
    match slot {
        Some(s) => f.with_slot(s),
        None => f,
    }
}

/// What each slot holds that it should not: NaN/Inf, nothing known, a missing residual, a
/// scale, the wrong side of the final norm; then the token shift and the tensor-parallel shard
/// the slots show together. Records the smallest neighbour margin in `stats`.
fn slot_findings(
    ids: &[SlotId],
    spec: &Spec,
    l: usize,
    hidden: usize,
    stats: &mut DiffStats,
) -> Vec<Finding> {
    let mut pending: Vec<Finding> = Vec::new();
    let mut emit = |slot: Option<usize>, f: Finding| pending.push(on_slot(slot, f));
    let expected = |slot: usize| spec.boundaries.get(slot).copied();
    let exp_text = |slot: usize| {
        expected(slot).map_or("nothing (the spec has fewer slots)".to_string(), |b| {
            format!("b = {b}")
        })
    };
    let mut shifted = Vec::new();
    for id in ids {
        let s = id.slot;
        if let (Some(found), Some(nm)) = (id.found, id.neighbour_margin)
            && found.state != State::NoResidual
        {
            stats.min_neighbour_margin =
                Some(stats.min_neighbour_margin.map_or(nm, |m: f64| m.min(nm)));
        }
        if id.non_finite > 0 {
            emit(
                Some(s),
                Finding::error(
                    FindingName::NonFinite,
                    format!("slot {s} holds {} NaN/Inf values", id.non_finite),
                )
                .with_fix("recapture; NaN/Inf in aux states usually means overflow in a half-precision path"));
        }
        let Some(found) = id.found else {
            emit(
                Some(s),
                Finding::error(
                    FindingName::Unidentified,
                    format!(
                        "slot {s} matches no reference state (closest: b = {} {}, cosine {:.4}); expected {}",
                        id.best.boundary,
                        id.best.state.describe(),
                        id.score.cosine,
                        exp_text(s)
                    ),
                ),
            );
            continue;
        };
        match found.state {
            State::NoResidual => emit(
                Some(s),
                Finding::error(
                    FindingName::MissingResidual,
                    format!(
                        "slot {s} holds what layer {} adds to the residual stream, without the stream itself \
                         (expected {}): the engine captured hidden_states instead of hidden_states + residual",
                        found.boundary - 1,
                        exp_text(s)
                    ),
                )
                .with_fix("capture hidden_states + residual (fused-residual engines keep them apart)")),
            State::Shifted(d) => shifted.push((s, d)),
            _ => {}
        }
        if id.scaled {
            emit(
                Some(s),
                Finding::error(
                    FindingName::Scale,
                    format!(
                        "slot {s} is b = {} scaled by {:.3} (cosine {:.6}, norm ratio {:.3}): cosine alone would call it a match",
                        found.boundary, id.score.norm_ratio, id.score.cosine, id.score.norm_ratio
                    ),
                )
                .with_fix("find the extra multiplier on this slot's capture path (an embedding scale applied twice, a stray normalisation)"));
        }
        if found.boundary == l && expected(s) == Some(Boundary(l)) {
            let side = match found.state {
                State::PreNorm => Some(FinalNorm::Pre),
                State::PostNorm => Some(FinalNorm::Post),
                _ => None,
            };
            if let (Some(side), Some(want)) = (side, spec.final_norm)
                && side != want
            {
                emit(
                    Some(s),
                    Finding::error(
                        FindingName::FinalNorm,
                        format!(
                            "slot {s} holds b = {l} {side}; the spec says training used it {want}"
                        ),
                    )
                    .with_fix(format!(
                        "capture the last layer's state {want} the final norm"
                    )),
                );
            }
        }
    }
    if !shifted.is_empty() {
        let (s, d) = shifted[0];
        let f = Finding::error(
            FindingName::TokenShift,
            format!(
                "{} of {} slots hold the states of the token {} the ids say (first: slot {s})",
                shifted.len(),
                ids.len(),
                if d > 0 { "after" } else { "before" }
            ),
        )
        .with_fix("pair hidden state t with token t (and the draft's embedding with token t + 1) when writing captures");
        emit(None, f);
    }
    if let Some(tp) = ids.iter().find_map(|id| id.shard_tp) {
        emit(
            None,
            Finding::error(
                FindingName::Shard,
                format!(
                    "each slot holds {} of {hidden} hidden features, the leading 1/{tp}: \
                     a tensor-parallel shard was saved without an all-gather",
                    hidden / tp
                ),
            )
            .with_fix(
                "all-gather the aux hidden states across ranks before saving (sglang PR 14280)",
            ),
        );
    }
    pending
}

/// The layout the slots hold (which boundaries, in which order) against the spec's.
fn layout_findings(ids: &[SlotId], spec: &Spec) -> Vec<Finding> {
    let mut pending: Vec<Finding> = Vec::new();
    let mut emit = |slot: Option<usize>, f: Finding| pending.push(on_slot(slot, f));
    let expected = |slot: usize| spec.boundaries.get(slot).copied();
    let found: Vec<Option<Boundary>> = ids
        .iter()
        .map(|id| id.found.map(|c| Boundary(c.boundary)))
        .collect();
    if found.iter().all(Option::is_some) {
        let found: Vec<Boundary> = found.into_iter().flatten().collect();
        if let Some((name, msg)) = classify(&found, &spec.boundaries, ("captured", "spec")) {
            // A wrong layer is a slot's fault; the other layout faults belong to the whole list.
            // A fault of some slots names the first; one of every slot belongs to the list.
            let differ = crate::judge::layout::differing_slots(&found, &spec.boundaries);
            let slot = (matches!(name, FindingName::WrongLayer | FindingName::OffByOne)
                && differ.len() < found.len())
            .then(|| differ.first().copied())
            .flatten();
            let fix = format!(
                "capture b = {} in this order: layer ids {:?} where ids name layer outputs (SpecForge, ModelOpt, TensorRT-LLM), \
                 {:?} where they name layer inputs (vLLM); or, if inference feeds what these captures hold, fix the spec",
                format_list(&spec.boundaries),
                spec.boundaries
                    .iter()
                    .map(|&b| Convention::Out.to_id(b))
                    .collect::<Vec<_>>(),
                spec.boundaries
                    .iter()
                    .map(|&b| Convention::In.to_id(b))
                    .collect::<Vec<_>>(),
            );
            emit(slot, Finding::error(name, msg).with_fix(fix));
        }
    } else {
        for (s, f) in found.iter().enumerate() {
            if let (Some(f), Some(e)) = (f, expected(s))
                && *f != e
            {
                emit(
                    Some(s),
                    Finding::error(
                        FindingName::WrongLayer,
                        format!("slot {s} holds b = {f}, the spec expects b = {e}"),
                    ),
                );
            }
        }
    }
    pending
}

/// The tensor a trainer learns to predict through the target's head, with the side of the
/// final norm the trainer expects it on.
struct TrainingTarget {
    id: SlotId,
    /// Where the file keeps it.
    name: &'static str,
    want: FinalNorm,
    /// Why the trainer expects that side (with its source).
    why: &'static str,
    /// Model-Optimizer without `hidden_states_prenorm`: a pre-norm state there is its vLLM
    /// dump's known defect.
    modelopt_unflagged: bool,
}

/// The training target a file carries, identified (`final_id`: its own tensor, SpecForge's
/// `hidden_state` or Model-Optimizer's `hidden_states`; `vllm_last`: vLLM's trailing
/// final-state slot).
fn training_target(
    sample: &Sample,
    vllm_last: Option<SlotId>,
    final_id: Option<SlotId>,
) -> Option<TrainingTarget> {
    match sample.format {
        Format::Vllm => vllm_last.map(|id| TrainingTarget {
            id,
            name: "the last slot of hidden_states",
            want: FinalNorm::Pre,
            why: "speculators trains on it through verifier_norm then verifier_lm_head \
                  (speculators/models/eagle3/core.py), so it must be the pre-norm state vLLM captures",
            modelopt_unflagged: false,
        }),
        Format::SpecForge => final_id.map(|id| TrainingTarget {
            id,
            name: "hidden_state",
            want: FinalNorm::Post,
            why: "SpecForge feeds it to the target's lm_head alone (offline_capture/sglang_backend/utils.py: \
                  sglang's post-norm state)",
            modelopt_unflagged: false,
        }),
        Format::ModelOpt => {
            let prenorm = matches!(
                sample.meta("hidden_states_prenorm"),
                Some(crate::readers::Value::Bool(true))
            );
            final_id.map(|id| TrainingTarget {
                id,
                name: "hidden_states",
                want: if prenorm { FinalNorm::Pre } else { FinalNorm::Post },
                why: if prenorm {
                    "the file sets hidden_states_prenorm, so Model-Optimizer's trainer applies the final \
                     norm to it first (plugins/modeling_final_norm.py)"
                } else {
                    "Model-Optimizer's trainer applies lm_head to it as stored unless the file sets \
                     hidden_states_prenorm (eagle/utils.py OfflineSupervisedDataset)"
                },
                modelopt_unflagged: !prenorm,
            })
        }
        _ => None,
    }
}

/// The training target must be the state after the last layer, on the side its trainer expects
/// (judged only when the reference holds both sides). A target shifted by a token alongside
/// shifted slots is already named by their `token-shift` finding.
fn check_target(
    t: &TrainingTarget,
    l: usize,
    sides_known: bool,
    slots_shifted: bool,
) -> Vec<Finding> {
    let name = t.name;
    let Some(found) = t.id.found else {
        return vec![Finding::error(
            FindingName::Unidentified,
            format!(
                "the training target ({name}) matches no reference state (closest: b = {} {}, cosine {:.4})",
                t.id.best.boundary,
                t.id.best.state.describe(),
                t.id.score.cosine
            ),
        )];
    };
    if let State::Shifted(d) = found.state {
        if slots_shifted {
            return Vec::new();
        }
        return vec![
            Finding::error(
                FindingName::TokenShift,
                format!(
                    "the training target ({name}) holds the state of the token {} the ids say",
                    if d > 0 { "after" } else { "before" }
                ),
            )
            .with_fix("pair hidden state t with token t when writing captures"),
        ];
    }
    if found.boundary != l || !matches!(found.state, State::PreNorm | State::PostNorm) {
        return vec![Finding::error(
            FindingName::WrongLayer,
            format!(
                "the training target ({name}) holds b = {} ({}); it must be the state after the last layer, b = {l}",
                found.boundary,
                found.state.describe()
            ),
        )
        .with_fix("store the final hidden state the trainer predicts through the target's head")];
    }
    let side = if found.state == State::PreNorm {
        FinalNorm::Pre
    } else {
        FinalNorm::Post
    };
    if side == t.want || !sides_known {
        return Vec::new();
    }
    let finding = if t.modelopt_unflagged && side == FinalNorm::Pre {
        Finding::error(
            FindingName::FinalNorm,
            format!(
                "the training target ({name}) is the pre-norm state and the file does not set \
                 hidden_states_prenorm: Model-Optimizer's trainer will apply lm_head to an unnormalised \
                 state (its vLLM dump writes files like this: compute_hidden_states_vllm.py), so the draft \
                 learns toward the wrong logits"
            ),
        )
        .with_fix(
            "set hidden_states_prenorm = True in these files (the trainer then applies the target's final \
             norm) or store the post-norm state",
        )
    } else {
        Finding::error(
            FindingName::FinalNorm,
            format!(
                "the training target ({name}) is the {side} final state; {}",
                t.why
            ),
        )
        .with_fix(format!("store the {} final state", t.want))
    };
    vec![finding]
}

/// What one slot holds against what the spec expects there, as a finding name (`None`: ok).
/// Each slot is judged on its own identification, so the correct slots of a faulty file say
/// `ok` and the faulty ones name their own fault.
fn slot_status(
    id: &SlotId,
    expected: Option<Boundary>,
    final_norm: Option<FinalNorm>,
    l: usize,
) -> Option<FindingName> {
    if id.non_finite > 0 {
        return Some(FindingName::NonFinite);
    }
    if id.shard_tp.is_some() {
        return Some(FindingName::Shard);
    }
    let Some(found) = id.found else {
        return Some(FindingName::Unidentified);
    };
    match found.state {
        State::NoResidual => return Some(FindingName::MissingResidual),
        State::Shifted(_) => return Some(FindingName::TokenShift),
        _ => {}
    }
    if id.scaled {
        return Some(FindingName::Scale);
    }
    let Some(want) = expected else {
        return Some(FindingName::Count);
    };
    let got = Boundary(found.boundary);
    if got == want {
        let side = match found.state {
            State::PreNorm => Some(FinalNorm::Pre),
            State::PostNorm => Some(FinalNorm::Post),
            _ => None,
        };
        return match (side, final_norm) {
            (Some(side), Some(want)) if got.0 == l && side != want => Some(FindingName::FinalNorm),
            _ => None,
        };
    }
    if got.is_embedding() || want.is_embedding() {
        return Some(FindingName::EmbeddingCapture);
    }
    if got.0.abs_diff(want.0) == 1 {
        return Some(FindingName::OffByOne);
    }
    Some(FindingName::WrongLayer)
}

/// The capture paths, for messages.
pub fn describe_paths(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::readers::{DType as CaptureDType, Format};

    /// A pass whose units the reader prepared sets up without rayon's global pool (the
    /// reader's file jobs hold it), and a unit it did not prepare is prepared here, each sample
    /// in order. Planted: the units mapped on the global pool as before; the first check
    /// waited for the held pool and failed after its 60 s.
    #[test]
    fn a_pass_of_prepared_units_waits_for_no_pool() {
        use crate::kernels::testing::{hold_the_global_pool, within};
        let units: Vec<(String, Vec<u32>)> = vec![("a".into(), vec![1, 2]), ("b".into(), vec![3])];
        let held = hold_the_global_pool();
        let reader = vec![Some(vec![10, 20]), Some(vec![30])];
        let got = within(std::time::Duration::from_secs(60), move || {
            host_work(&units, reader, |s: &u32| s * 100)
        });
        drop(held);
        assert_eq!(got, Some(vec![vec![10, 20], vec![30]]));
        let units: Vec<(String, Vec<u32>)> = vec![("a".into(), vec![1, 2]), ("b".into(), vec![3])];
        let got = host_work(&units, vec![Some(vec![10, 20]), None], |s: &u32| s * 100);
        assert_eq!(got, vec![vec![10, 20], vec![300]]);
    }

    /// A SpecForge-shaped sample of `rows` tokens: three aux slots and the training target,
    /// captured in `dtype` (the values do not matter here).
    fn sample(dtype: CaptureDType, rows: usize, h: usize) -> Sample {
        let tensor = |shape: Vec<usize>| {
            let bytes = shape.iter().product::<usize>() * dtype.size();
            HostTensor::from_shared(dtype, shape, std::sync::Arc::new(vec![0; bytes]), 0).unwrap()
        };
        Sample {
            file: PathBuf::from("data_0.ckpt"),
            index: 0,
            format: Format::Torch,
            token_ids: Some(vec![0; rows]),
            loss_mask: None,
            aux: Some(tensor(vec![rows, 3 * h])),
            layers: None,
            final_hidden: Some(tensor(vec![rows, h])),
            named: Vec::new(),
            meta: Vec::new(),
            notes: Vec::new(),
        }
    }

    /// A pass counts what its samples keep where its budget is: on a GPU running a bf16
    /// forward, bf16 captures as bf16 slots beside bf16 states and nothing of the host's; f32
    /// captures as f32 slots; on the CPU, f32 throughout and the captures stored and widened
    /// too. (The bench's 8B-shape sample at T = 512 keeps 59 MB on the GPU.)
    #[test]
    fn a_pass_counts_what_its_samples_keep_where_its_budget_is() {
        let (t, h, l) = (512, 4096, 32);
        let gpu = Kept {
            state_bytes: 2,
            on_device: true,
        };
        let cpu = Kept {
            state_bytes: 4,
            on_device: false,
        };
        let captured = (4 * t * h) as u64;
        // Each of the four slots' best candidate's state, and the ring.
        let states = ((4 + online::RING) * t * h) as u64;
        let edges = (2 * online::EDGE * h * (2 * l + 2)) as u64;
        let bf16 = sample(CaptureDType::BF16, t, h);
        let f32s = sample(CaptureDType::F32, t, h);
        let on_gpu = unit_bytes(std::slice::from_ref(&bf16), h, l, gpu);
        assert_eq!(on_gpu, 2 * captured + 2 * (states + edges));
        assert_eq!((on_gpu as f64 / 1e6).round(), 59.0);
        assert_eq!(
            unit_bytes(std::slice::from_ref(&f32s), h, l, gpu),
            4 * captured + 2 * (states + edges)
        );
        assert_eq!(
            unit_bytes(&[bf16.clone(), bf16], h, l, cpu),
            2 * (8 * captured + 4 * captured + 4 * (states + edges))
        );
    }
}
