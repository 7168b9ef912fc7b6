//! Engine resolvers: which boundaries each serving or training stack feeds to the draft's `fc`.
//!
//! "The engine" is really (engine, version, capture path, target architecture, where the ids
//! are read): [`rules::RULES`] holds one audited row per case, each naming its upstream source.
//! [`select`] picks the row for an [`EngineSel`] and an architecture, [`resolve`] applies it to
//! a draft's ids, [`ids_for`] inverts it into a fix. Everything leaves this module as canonical
//! boundaries ([`Boundary`]); no other module knows about "+1".

pub mod drafts;
pub mod rules;
#[cfg(test)]
mod tests;

use crate::boundary::{Boundary, FinalNorm, default_boundaries};
pub use crate::config::DraftIds;
use rules::{
    Capture, DefaultList, IdCheck, IdsFrom, MinusOne, Offset, Order, RULES, Reach, Rule, When,
};
use serde::{Serialize, Serializer};
use std::fmt;

/// The engines eagle-check knows, by their CLI names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Engine {
    Sglang,
    Vllm,
    Trtllm,
    Specforge,
    /// SafeAILab EAGLE (training and inference share the code).
    Eagle,
    /// NVIDIA Model-Optimizer's hidden-state dumps.
    Modelopt,
    /// speculators (vLLM-based data generation).
    Speculators,
}

impl Engine {
    pub const ALL: [Engine; 7] = [
        Engine::Sglang,
        Engine::Vllm,
        Engine::Trtllm,
        Engine::Specforge,
        Engine::Eagle,
        Engine::Modelopt,
        Engine::Speculators,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Engine::Sglang => "sglang",
            Engine::Vllm => "vllm",
            Engine::Trtllm => "trtllm",
            Engine::Specforge => "specforge",
            Engine::Eagle => "eagle",
            Engine::Modelopt => "modelopt",
            Engine::Speculators => "speculators",
        }
    }

    pub fn from_name(name: &str) -> Option<Engine> {
        Engine::ALL.into_iter().find(|e| e.name() == name)
    }

    /// The rows of this engine, newest band first.
    fn rules(self) -> impl Iterator<Item = &'static Rule> {
        RULES.iter().filter(move |r| r.engine == self)
    }

    /// The capture paths this engine has (the first is its default).
    pub fn paths(self) -> Vec<&'static str> {
        let mut out: Vec<&'static str> = Vec::new();
        for r in self.rules() {
            if !out.contains(&r.path) {
                out.push(r.path);
            }
        }
        out
    }

    /// The audited versions, newest first.
    pub fn versions(self) -> Vec<Version> {
        let mut out: Vec<Version> = self.rules().map(|r| r.since).collect();
        out.sort_unstable_by(|a, b| b.cmp(a));
        out.dedup();
        out
    }
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A release number, compared component by component (`0.5.10 < 0.5.14 < 0.5.23`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version(pub [u32; 3]);

impl Version {
    pub fn parse(text: &str) -> Option<Version> {
        let mut parts = [0u32; 3];
        let mut n = 0;
        for piece in text.trim_start_matches('v').split('.') {
            if n == 3 {
                return None;
            }
            parts[n] = piece.parse().ok()?;
            n += 1;
        }
        (n > 0).then_some(Version(parts))
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c] = self.0;
        write!(f, "{a}.{b}.{c}")
    }
}

impl Serialize for Version {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// An engine as the user names it: `sglang`, `sglang@0.5.10`, `trtllm:two-model`,
/// `vllm:v2@0.33.0`. `sglang-legacy` is an alias of `sglang@0.5.10` (before PR 25454).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EngineSel {
    pub engine: Engine,
    /// `None`: the engine's default path.
    pub path: Option<&'static str>,
    /// `None`: the newest audited version.
    pub version: Option<Version>,
}

impl EngineSel {
    pub fn newest(engine: Engine) -> EngineSel {
        EngineSel {
            engine,
            path: None,
            version: None,
        }
    }

    /// Parses `NAME[:PATH][@VERSION]`; the error says what is known.
    pub fn parse(text: &str) -> Result<EngineSel, String> {
        if text == "sglang-legacy" {
            return Ok(EngineSel {
                engine: Engine::Sglang,
                path: None,
                version: Some(Version([0, 5, 10])),
            });
        }
        let (head, version) = match text.split_once('@') {
            Some((h, v)) => (
                h,
                Some(Version::parse(v).ok_or_else(|| {
                    format!("`{text}`: `{v}` is not a version (expected e.g. 0.5.10)")
                })?),
            ),
            None => (text, None),
        };
        let (name, path) = match head.split_once(':') {
            Some((n, p)) => (n, Some(p)),
            None => (head, None),
        };
        let engine = Engine::from_name(name).ok_or_else(|| {
            format!(
                "unknown engine `{name}` (known: {}; NAME@VERSION picks an audited version, \
                 NAME:PATH a capture path)",
                engine_names()
            )
        })?;
        let path = match path {
            None => None,
            Some(p) => Some(
                engine
                    .paths()
                    .into_iter()
                    .find(|known| !known.is_empty() && *known == p)
                    .ok_or_else(|| {
                        let known: Vec<&str> = engine
                            .paths()
                            .into_iter()
                            .filter(|k| !k.is_empty())
                            .collect();
                        if known.is_empty() {
                            format!("{engine} has one capture path; `:{p}` names none")
                        } else {
                            format!(
                                "{engine} has no capture path `{p}` (known: {})",
                                known.join(", ")
                            )
                        }
                    })?,
            ),
        };
        Ok(EngineSel {
            engine,
            path,
            version,
        })
    }
}

impl fmt::Display for EngineSel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.engine.name())?;
        if let Some(p) = self.path {
            write!(f, ":{p}")?;
        }
        if let Some(v) = self.version {
            write!(f, "@{v}")?;
        }
        Ok(())
    }
}

impl Serialize for EngineSel {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Every engine name, for messages.
pub fn engine_names() -> String {
    Engine::ALL.map(Engine::name).join(", ")
}

/// The rule that applies, and what had to be assumed to pick it.
#[derive(Debug, Clone)]
pub struct Selected {
    pub rule: &'static Rule,
    pub notes: Vec<String>,
}

/// Picks the row for `sel` on a target of architecture `arch` (`model_type`), saying what it
/// assumed: the newest version when none is named, the band a version between audited ones
/// falls in, the generic rule when the architecture is unknown.
pub fn select(sel: &EngineSel, arch: Option<&str>) -> Selected {
    let family = arch.map(crate::config::family::family_name);
    let arch = family.as_deref();
    let engine = sel.engine;
    let path = sel.path.unwrap_or_else(|| engine.paths()[0]);
    let mut notes = Vec::new();
    // The audited versions of this path, newest first.
    let mut versions: Vec<Version> = engine
        .rules()
        .filter(|r| r.path == path)
        .map(|r| r.since)
        .collect();
    versions.sort_unstable_by(|a, b| b.cmp(a));
    versions.dedup();
    // A version whose generic row refuses no longer has the path (vLLM 0.34.0 removed V1).
    let gone = |v: Version| {
        engine
            .rules()
            .find(|r| r.since == v && r.path == path && r.archs.is_empty())
            .and_then(|r| r.refuses)
    };
    let band = match sel.version {
        None => {
            let newest = versions[0];
            match versions.iter().copied().find(|&v| gone(v).is_none()) {
                Some(v) if v != newest => {
                    notes.push(format!(
                        "{engine} {newest} has no `{path}` path: applying the rule read from {v}, \
                         the newest release that has it ({})",
                        gone(newest).unwrap_or_default()
                    ));
                    v
                }
                _ => newest,
            }
        }
        Some(want) => match versions.iter().find(|&&v| v <= want) {
            Some(&v) => {
                if v != want && versions.len() > 1 {
                    notes.push(format!(
                        "{engine} {want} was not audited: applying the rule read from {v}, the newest audited version before it"
                    ));
                }
                v
            }
            None => {
                let oldest = *versions.last().unwrap_or(&want);
                notes.push(format!(
                    "{engine} {want} is older than every audited version: applying the rule read from {oldest}"
                ));
                oldest
            }
        },
    };
    let rows: Vec<&'static Rule> = engine
        .rules()
        .filter(|r| r.since == band && r.path == path)
        .collect();
    let generic = rows.iter().copied().find(|r| r.archs.is_empty());
    let specific = arch.and_then(|a| rows.iter().copied().find(|r| r.archs.contains(&a)));
    let rule = match (specific, generic, arch) {
        (Some(r), _, _) => r,
        (None, Some(g), Some(a)) => {
            if rows.len() > 1 {
                notes.push(format!(
                    "{engine} has no rule of its own for `{a}` targets: applying its generic rule ({})",
                    offset_words(g.offset)
                ));
            }
            g
        }
        (None, Some(g), None) => {
            if rows.len() > 1 {
                let differ: Vec<&str> = rows
                    .iter()
                    .filter(|r| !r.archs.is_empty() && !r.same_mapping(g))
                    .flat_map(|r| r.archs.iter().copied())
                    .collect();
                if !differ.is_empty() {
                    notes.push(format!(
                        "the target's architecture is unknown (pass --target, or set target.model_type in the spec): \
                         applying {engine}'s generic rule ({}); {engine} reads ids differently on {} targets",
                        offset_words(g.offset),
                        differ.join(", ")
                    ));
                }
            }
            g
        }
        // Every band has a generic row (checked by a test); this is the first row as a last resort.
        (None, None, _) => rows.first().copied().unwrap_or(&RULES[0]),
    };
    Selected { rule, notes }
}

/// How an engine arrived at its boundaries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum How {
    /// Explicit ids through the row's offset rule.
    Explicit,
    /// No ids read: the engine's default list.
    DefaultFallback,
    /// The engine ignores ids and hard-codes its layers.
    HardCoded,
    /// The engine raises on these ids (or on this target).
    Refused,
}

/// One `fc` slot as an engine fills it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct FedSlot {
    /// The id that selected this slot (`None` for defaults and hard-coded layers).
    pub id: Option<i64>,
    pub boundary: Boundary,
    /// At b = L: which side of the final norm.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub norm: Option<FinalNorm>,
}

/// Something wrong with the ids themselves, found while resolving.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum IdProblem {
    /// The id names no boundary this engine captures; it is dropped from the feed.
    OutOfRange { id: i64, reason: String },
    /// The same position twice.
    Duplicate { id: i64, collapsed: bool },
    /// Ids not ascending: the engine reorders them.
    Unsorted { ids: Vec<i64> },
    /// The engine raises on these ids or this target.
    Refused { reason: String },
    /// This engine version cannot serve EAGLE-3 on the target's architecture at all (its model
    /// file has no capture, or the engine cannot load the target).
    Unsupported { reason: String },
    /// The ids in the draft config are not where this engine reads them.
    NotRead {
        /// Where the config has them.
        written: &'static str,
        /// Where the engine looks.
        read: String,
        /// The check assumes the ids are passed where the engine looks (its own flag or
        /// setting); otherwise the engine silently uses its default.
        assumed: bool,
    },
}

/// What an engine feeds to `fc`, in order, and how it decided.
#[derive(Debug, Clone, Serialize)]
pub struct Feed {
    pub engine: EngineSel,
    #[serde(skip)]
    pub rule: &'static Rule,
    pub how: How,
    /// The ids the engine read (`None`: it read none).
    pub ids: Option<Vec<i64>>,
    pub slots: Vec<FedSlot>,
    /// The state stored after the `fc` slots as the training target, when the engine stores one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<FedSlot>,
    pub problems: Vec<IdProblem>,
    /// What was assumed to pick the rule.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    /// When the only crash is at b = 0 (the residual is `None` before layer 0): what an engine
    /// patched to capture the embedding there feeds. The founding incident ran such a patch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub if_patched: Option<Vec<FedSlot>>,
}

impl Feed {
    pub fn boundaries(&self) -> Vec<Boundary> {
        self.slots.iter().map(|s| s.boundary).collect()
    }

    /// The slots that reach `fc`: the fed ones, or, when the engine crashes only at b = 0, what
    /// an engine patched to capture the embedding there feeds.
    pub fn fed_slots(&self) -> &[FedSlot] {
        match (&self.if_patched, self.refused()) {
            (Some(p), true) => p,
            _ => &self.slots,
        }
    }

    /// Whether the engine cannot run at all with these ids.
    pub fn refused(&self) -> bool {
        self.how == How::Refused
    }

    /// A short account of the rule for messages, e.g. `llama.py: +1 on every id (b = id + 1)`.
    pub fn describe(&self) -> String {
        let what = match self.how {
            How::Explicit | How::Refused => offset_words(self.rule.offset),
            How::DefaultFallback => "no ids read: the engine's default",
            How::HardCoded => "hard-coded layers, config ids ignored",
        };
        format!("{}: {what}", short_source(self.rule))
    }

    /// What is fed, in words: the boundaries, or why nothing is.
    pub fn fed_words(&self) -> String {
        if !self.refused() {
            return crate::boundary::format_list(&self.boundaries());
        }
        match &self.if_patched {
            Some(p) => format!(
                "none: the engine refuses these ids (patched to capture the embedding: {})",
                crate::boundary::format_list(&p.iter().map(|s| s.boundary).collect::<Vec<_>>())
            ),
            None => "none: the engine refuses these ids".to_string(),
        }
    }

    /// The engine with the version its rule was read from, e.g. `sglang@0.5.23`.
    pub fn engine_label(&self) -> String {
        let mut sel = self.engine;
        sel.version = Some(self.rule.since).filter(|v| v.0 != [0, 0, 0]);
        sel.path = Some(self.rule.path).filter(|p| !p.is_empty());
        sel.to_string()
    }
}

fn short_source(rule: &Rule) -> &'static str {
    let file = rule.source.split_whitespace().next().unwrap_or(rule.source);
    file.rsplit('/').next().unwrap_or(file)
}

/// A rule's id mapping in words, e.g. `+1 on every id (b = id + 1)`.
pub fn rule_words(rule: &Rule) -> &'static str {
    offset_words(rule.offset)
}

fn offset_words(offset: Offset) -> &'static str {
    match offset {
        Offset::PlusOne => "+1 on every id (b = id + 1)",
        Offset::Raw => "ids used raw (b = id)",
        Offset::PlusOneIfFirstIsOne => "+1 only when the first id is 1, else raw (PR 25454)",
        Offset::RawIfMaxIsL => "raw when the largest id is L, else +1",
        Offset::Ignored => "ids ignored",
    }
}

/// Where the draft config's ids sit and where the engine reads them. `(ids read, problem)`.
fn read_ids(rule: &Rule, ids: &DraftIds) -> (Option<Vec<i64>>, Option<IdProblem>) {
    const TOP: &str = "eagle_aux_hidden_state_layer_ids (top level)";
    const NESTED: &str = "eagle_config.eagle_aux_hidden_state_layer_ids";
    match rule.ids_from {
        IdsFrom::Nested => match (&ids.nested, &ids.top) {
            (Some(n), _) => (Some(n.clone()), None),
            (None, Some(_)) => (
                None,
                Some(IdProblem::NotRead {
                    written: TOP,
                    read: NESTED.into(),
                    assumed: false,
                }),
            ),
            (None, None) => (None, None),
        },
        IdsFrom::Top => match (&ids.top, &ids.nested) {
            (Some(t), _) => (Some(t.clone()), None),
            (None, Some(_)) => (
                None,
                Some(IdProblem::NotRead {
                    written: NESTED,
                    read: TOP.into(),
                    assumed: false,
                }),
            ),
            (None, None) => (None, None),
        },
        IdsFrom::TopThenNested => (ids.top.clone().or_else(|| ids.nested.clone()), None),
        IdsFrom::OverrideThenNested(_) => match (&ids.nested, &ids.top) {
            (Some(n), _) => (Some(n.clone()), None),
            (None, Some(t)) => (
                Some(t.clone()),
                Some(IdProblem::NotRead {
                    written: TOP,
                    read: format!("{NESTED} or its run override (assumed passed there)"),
                    assumed: true,
                }),
            ),
            (None, None) => (None, None),
        },
        // The engine's own setting: we check the ids the config holds as if passed there.
        IdsFrom::Setting(setting) => match ids.any() {
            Some(v) => (
                Some(v.to_vec()),
                Some(IdProblem::NotRead {
                    written: if ids.nested.is_some() { NESTED } else { TOP },
                    read: format!("{setting} (the draft config is not read; assumed passed there)"),
                    assumed: true,
                }),
            ),
            None => (None, None),
        },
        IdsFrom::Nowhere => (None, None),
    }
}

/// Where one id lands: a slot, silently nowhere, or a crash.
enum Landing {
    Slot(FedSlot),
    Dropped(IdProblem),
    Crash(IdProblem),
}

/// Applies `reach` to an id that mapped to boundary `b` (possibly outside `0..=L`).
fn land(reach: Reach, id: Option<i64>, b: i64, num_layers: usize) -> Landing {
    let l = num_layers as i64;
    let shown = id.unwrap_or(b);
    match reach {
        Reach::Captured(norm) if (0..=l).contains(&b) => Landing::Slot(FedSlot {
            id,
            boundary: Boundary(b as usize),
            norm: if b == l { norm } else { None },
        }),
        Reach::Captured(_) => Landing::Dropped(IdProblem::OutOfRange {
            id: shown,
            reason: format!("b = {b} is outside 0..={l}"),
        }),
        Reach::Dropped(why) => Landing::Dropped(IdProblem::OutOfRange {
            id: shown,
            reason: why.to_string(),
        }),
        Reach::Crash(why) => Landing::Crash(IdProblem::Refused {
            reason: format!("layer id {shown}: {why}"),
        }),
        // `self.layers[b]`: negative b counts from the end and tags that layer's input.
        Reach::PythonIndex if (-l..0).contains(&b) => Landing::Slot(FedSlot {
            id,
            boundary: Boundary((b + l) as usize),
            norm: None,
        }),
        Reach::PythonIndex => Landing::Crash(IdProblem::Refused {
            reason: format!("layer id {shown}: self.layers[{b}] raises IndexError (L = {l})"),
        }),
    }
}

/// The boundary an id names under the row's offset (`None` when it overflows).
fn offset_id(offset: Offset, plus_one: bool, id: i64) -> Option<i64> {
    match offset {
        Offset::PlusOne => id.checked_add(1),
        Offset::Raw | Offset::Ignored => Some(id),
        Offset::PlusOneIfFirstIsOne | Offset::RawIfMaxIsL => {
            if plus_one {
                id.checked_add(1)
            } else {
                Some(id)
            }
        }
    }
}

/// Places one id (or one default boundary, `id = None`) under the row's edge rules.
fn place(rule: &Rule, id: Option<i64>, b: i64, num_layers: usize) -> Landing {
    let l = num_layers as i64;
    if id == Some(-1) && rule.minus_one == MinusOne::FinalPostNorm {
        return Landing::Slot(FedSlot {
            id,
            boundary: Boundary(num_layers),
            norm: Some(FinalNorm::Post),
        });
    }
    if b == 0 {
        land(rule.embedding, id, b, num_layers)
    } else if b == l {
        land(rule.last, id, b, num_layers)
    } else if (1..l).contains(&b) {
        land(Reach::Captured(None), id, b, num_layers)
    } else {
        land(rule.outside, id, b, num_layers)
    }
}

/// The ids a check refuses, with the reason.
fn check_ids(rule: &Rule, engine: Engine, ids: &[i64], num_layers: usize) -> Option<String> {
    let l = num_layers as i64;
    let mut unique = ids.to_vec();
    unique.sort_unstable();
    unique.dedup();
    let distinct = unique.len() == ids.len();
    let bad = match rule.check {
        IdCheck::None => false,
        IdCheck::ThreeDistinctBelowL => {
            ids.len() != 3 || !distinct || ids.iter().any(|&k| !(0..l).contains(&k))
        }
        IdCheck::ThreeDistinct => ids.len() != 3 || !distinct || ids.iter().any(|&k| k < 0),
        IdCheck::BelowL => ids.iter().any(|&k| !(0..l).contains(&k)),
        IdCheck::DistinctUpToL => !distinct || ids.iter().any(|&k| !(0..=l).contains(&k)),
        IdCheck::ThreeDistinctLayers => unique.len() < 3,
    };
    let need = match rule.check {
        IdCheck::None => "",
        IdCheck::ThreeDistinctBelowL => "exactly 3 distinct ids in 0..L",
        IdCheck::ThreeDistinct => "exactly 3 distinct non-negative ids",
        IdCheck::BelowL => "ids in 0..L",
        IdCheck::DistinctUpToL => "distinct ids in 0..=L",
        IdCheck::ThreeDistinctLayers => {
            "three distinct layers (it indexes the first three captured states)"
        }
    };
    bad.then(|| format!("{engine} requires {need} (L = {l}), got {ids:?}"))
}

/// The default list as (id, boundary) pairs before the edge rules.
fn default_positions(rule: &Rule, num_layers: usize) -> Vec<(Option<i64>, i64)> {
    let l = num_layers as i64;
    let outputs = [1, l / 2 - 1, l - 4];
    match rule.default {
        DefaultList::InputsOf => default_boundaries(num_layers)
            .into_iter()
            .map(|b| (None, b.0 as i64))
            .collect(),
        DefaultList::OutputsOf => outputs.iter().map(|&k| (None, k + 1)).collect(),
        DefaultList::ModeloptClamped => {
            let mut ids: Vec<i64> = outputs.iter().map(|&k| k.max(0)).collect();
            ids.sort_unstable();
            ids.dedup();
            ids.into_iter().map(|k| (None, k + 1)).collect()
        }
        DefaultList::Refused(_) => Vec::new(),
    }
}

/// Resolves what the engine feeds to `fc` for a draft with `ids` on a target of `num_layers`
/// layers and architecture `arch`.
pub fn resolve(sel: &EngineSel, arch: Option<&str>, ids: &DraftIds, num_layers: usize) -> Feed {
    let Selected { rule, mut notes } = select(sel, arch);
    let mut problems = Vec::new();
    let (read, location) = read_ids(rule, ids);
    problems.extend(location);
    // A feed the engine never runs: what it read, why not, and no slots.
    let stopped = |ids: Option<Vec<i64>>, problems: Vec<IdProblem>, notes, patched| Feed {
        engine: *sel,
        rule,
        how: How::Refused,
        ids,
        slots: Vec::new(),
        target: None,
        problems,
        notes,
        if_patched: patched,
    };
    if let Some(why) = rule.refuses {
        problems.push(IdProblem::Unsupported {
            reason: why.to_string(),
        });
        return stopped(read, problems, notes, None);
    }
    let (how, positions) = match positions(sel, rule, &read, num_layers, &mut problems) {
        Ok(p) => p,
        Err(Refusal { ids, reason }) => {
            problems.push(IdProblem::Refused { reason });
            return stopped(ids, problems, notes, None);
        }
    };
    let mut placed = place_all(rule, &positions, num_layers, &mut problems);
    if rule.strict_count && placed.lost > 0 && how == How::Explicit {
        placed.embedding_crash_only = false;
        placed.crashes.push(IdProblem::Refused {
            reason: format!(
                "{} of {} ids capture nothing distinct, and {} raises when it captures fewer states than ids",
                placed.lost,
                read.as_ref().map_or(0, Vec::len),
                sel.engine
            ),
        });
    }
    let Placed {
        mut slots,
        crashes,
        embedding_crash_only,
        lost,
    } = placed;
    order_slots(rule.order, &mut slots);
    if !crashes.is_empty() {
        problems.extend(crashes);
        let patched = embedding_crash_only && lost == 0;
        return stopped(read, problems, notes, patched.then_some(slots));
    }
    let target = if rule.final_target { slots.pop() } else { None };
    notes.extend(caveats(rule, how, read.as_deref()));
    Feed {
        engine: *sel,
        rule,
        how,
        ids: read,
        slots,
        target,
        problems,
        notes,
        if_patched: None,
    }
}

/// A position to capture: the draft's id that names it (none for a default), and b.
type Position = (Option<i64>, i64);

/// Why the engine refuses to run, with the ids it read.
struct Refusal {
    ids: Option<Vec<i64>>,
    reason: String,
}

/// The positions to capture, `(id, b)` each: explicit ids through the rule's offset, or its
/// default list (itself checked where the engine checks it), and b = L last when the rule
/// captures the training target. Problems with the ids that do not stop the engine go to
/// `problems`.
fn positions(
    sel: &EngineSel,
    rule: &'static Rule,
    read: &Option<Vec<i64>>,
    num_layers: usize,
    problems: &mut Vec<IdProblem>,
) -> Result<(How, Vec<Position>), Refusal> {
    let l = num_layers as i64;
    let refused = |ids: Option<Vec<i64>>, reason: String| Err(Refusal { ids, reason });
    let (how, mut positions): (How, Vec<Position>) = match (read, rule.offset) {
        (_, Offset::Ignored) => (How::HardCoded, default_positions(rule, num_layers)),
        (None, _) => {
            if let DefaultList::Refused(why) = rule.default {
                return refused(None, why.to_string());
            }
            if let Some(n) = rule.default_raises_up_to.filter(|&n| num_layers <= n) {
                return refused(
                    None,
                    format!(
                        "no layer ids and L = {num_layers}: its default [1, L//2-1, L-4] raises for L <= {n}"
                    ),
                );
            }
            (How::DefaultFallback, default_positions(rule, num_layers))
        }
        (Some(ids), offset) => {
            if let Some(reason) = check_ids(rule, sel.engine, ids, num_layers) {
                return refused(read.clone(), reason);
            }
            let plus_one = match offset {
                Offset::PlusOneIfFirstIsOne => ids.first() == Some(&1),
                Offset::RawIfMaxIsL => ids.iter().max() != Some(&l),
                _ => true,
            };
            let mut positions = Vec::with_capacity(ids.len());
            for &id in ids {
                match offset_id(offset, plus_one, id) {
                    Some(b) => positions.push((Some(id), b)),
                    None => problems.push(IdProblem::OutOfRange {
                        id,
                        reason: "it overflows".into(),
                    }),
                }
            }
            if ids.windows(2).any(|w| w[0] > w[1]) {
                problems.push(IdProblem::Unsorted { ids: ids.clone() });
            }
            (How::Explicit, positions)
        }
    };
    // A default with its own check (SpecForge validates its default like any list).
    if how != How::Explicit && rule.check_default {
        let as_ids: Vec<i64> = positions.iter().map(|&(_, b)| b - 1).collect();
        let as_b: Vec<i64> = positions.iter().map(|&(_, b)| b).collect();
        let checked = if rule.check == IdCheck::ThreeDistinctLayers {
            &as_b
        } else {
            &as_ids
        };
        if let Some(reason) = check_ids(rule, sel.engine, checked, num_layers) {
            return refused(None, format!("its default: {reason}"));
        }
    }
    if rule.final_target && !positions.iter().any(|&(_, b)| b == l) {
        positions.push((None, l));
    }
    Ok((how, positions))
}

/// Where the positions landed.
struct Placed {
    slots: Vec<FedSlot>,
    /// What makes the engine raise.
    crashes: Vec<IdProblem>,
    /// Whether every crash is the one at b = 0 that a patch capturing the embedding avoids.
    embedding_crash_only: bool,
    /// Positions that fed no distinct slot.
    lost: usize,
}

/// Places each position as the rule does: a slot, dropped, a duplicate (collapsed where the
/// rule dedups), or a crash.
fn place_all(
    rule: &'static Rule,
    positions: &[Position],
    num_layers: usize,
    problems: &mut Vec<IdProblem>,
) -> Placed {
    let mut slots: Vec<FedSlot> = Vec::new();
    let mut crashes = Vec::new();
    let mut embedding_crash_only = true;
    let mut lost = 0usize;
    for &(id, b) in positions {
        let mut landing = place(rule, id, b, num_layers);
        // A crash at b = 0 (no residual before layer 0): keep what a patch that captures the
        // embedding there would feed, as the founding incident's engine did.
        if let Landing::Crash(p) = &landing
            && b == 0
        {
            crashes.push(p.clone());
            landing = land(Reach::Captured(None), id, 0, num_layers);
        }
        match landing {
            Landing::Slot(slot) => {
                if slots
                    .iter()
                    .any(|s| s.boundary == slot.boundary && s.norm == slot.norm)
                {
                    if let Some(id) = id {
                        problems.push(IdProblem::Duplicate {
                            id,
                            collapsed: rule.dedup,
                        });
                    }
                    if rule.dedup {
                        lost += 1;
                        continue;
                    }
                }
                slots.push(slot);
            }
            Landing::Dropped(p) => {
                lost += 1;
                problems.push(p);
            }
            Landing::Crash(p) => {
                embedding_crash_only = false;
                crashes.push(p);
            }
        }
    }
    Placed {
        slots,
        crashes,
        embedding_crash_only,
        lost,
    }
}

/// The rule's caveats that apply to this feed.
fn caveats(rule: &Rule, how: How, read: Option<&[i64]>) -> Vec<String> {
    rule.caveats
        .iter()
        .filter(|(when, _)| match when {
            When::ExplicitIds => how == How::Explicit,
            When::MinusOne => read.is_some_and(|ids| ids.contains(&-1)),
            When::Always => true,
        })
        .map(|(_, caveat)| caveat.to_string())
        .collect()
}

fn order_slots(order: Order, slots: &mut Vec<FedSlot>) {
    match order {
        Order::Ascending => slots.sort_by_key(|s| (s.boundary, s.norm == Some(FinalNorm::Post))),
        Order::SortedIds => slots.sort_by_key(|s| s.id),
        Order::SortedIdsMinusOneLast => {
            slots.sort_by_key(|s| s.id);
            if slots.first().is_some_and(|s| s.id == Some(-1)) {
                let first = slots.remove(0);
                slots.push(first);
            }
        }
    }
}

/// The serving engines that can feed the residual stream on `arch` targets, for a fix: of
/// `sel`'s engine and path, the oldest newer audited version that serves it, else the newest
/// older one; then, of each other serving engine audited per architecture, the newest version
/// that serves it. Empty when none is known.
pub fn serving_alternatives(sel: &EngineSel, arch: Option<&str>) -> Vec<String> {
    let serves = |s: &EngineSel| {
        let rule = select(s, arch).rule;
        rule.refuses.is_none() && rule.captures == Capture::Residual
    };
    let at = |base: &EngineSel, v: Version| EngineSel {
        version: Some(v),
        ..*base
    };
    let band = select(sel, arch).rule.since;
    // Newest first.
    let versions = sel.engine.versions();
    let newer = versions.iter().rev().filter(|&&v| v > band);
    let older = versions.iter().filter(|&&v| v < band);
    let mut out: Vec<String> = newer
        .chain(older)
        .map(|&v| at(sel, v))
        .find(|s| serves(s))
        .map(|s| s.to_string())
        .into_iter()
        .collect();
    for engine in [Engine::Sglang, Engine::Vllm] {
        if engine == sel.engine {
            continue;
        }
        let other = EngineSel::newest(engine);
        if let Some(s) = engine
            .versions()
            .into_iter()
            .map(|v| at(&other, v))
            .find(|s| serves(s))
        {
            out.push(s.to_string());
        }
    }
    out
}

/// A slot as a fix must produce it: a boundary, and at b = L its side of the norm.
pub type Want = (Boundary, Option<FinalNorm>);

/// The ids to give `sel` so that it feeds exactly `want`, in order, with the setting to put them
/// in. `None` when no id list can (hard-coded engines, orders an engine never produces, ...).
pub fn ids_for(
    sel: &EngineSel,
    arch: Option<&str>,
    want: &[Want],
    num_layers: usize,
) -> Option<(Vec<i64>, String)> {
    let rule = select(sel, arch).rule;
    let out: Vec<i64> = want.iter().map(|&(b, _)| b.0 as i64 - 1).collect();
    let raw: Vec<i64> = want.iter().map(|&(b, _)| b.0 as i64).collect();
    let post_as_minus_one: Vec<i64> = want
        .iter()
        .map(|&(b, side)| {
            if b.0 == num_layers && side == Some(FinalNorm::Post) {
                -1
            } else {
                b.0 as i64 - 1
            }
        })
        .collect();
    let mut candidates = vec![out, raw, post_as_minus_one];
    // Engines that reorder: offer the ids in the order that sorts to `want`.
    for c in candidates.clone() {
        let mut sorted = c;
        sorted.sort_unstable();
        candidates.push(sorted);
    }
    let setting = match rule.ids_from {
        IdsFrom::Nested | IdsFrom::OverrideThenNested(_) => {
            "eagle_config.eagle_aux_hidden_state_layer_ids".to_string()
        }
        IdsFrom::Top => "the top-level eagle_aux_hidden_state_layer_ids".to_string(),
        IdsFrom::TopThenNested => "eagle_aux_hidden_state_layer_ids".to_string(),
        IdsFrom::Setting(s) => s.to_string(),
        IdsFrom::Nowhere => return None,
    };
    let ids_in_place = |ids: &[i64]| match rule.ids_from {
        IdsFrom::Top => DraftIds {
            top: Some(ids.to_vec()),
            nested: None,
        },
        _ => DraftIds::nested(ids),
    };
    candidates
        .into_iter()
        .find(|ids| {
            let feed = resolve(sel, arch, &ids_in_place(ids), num_layers);
            feed.how == How::Explicit
                && feed.slots.len() == want.len()
                && feed.slots.iter().zip(want).all(|(s, &(b, side))| {
                    s.boundary == b && (b.0 != num_layers || side.is_none() || s.norm == side)
                })
                && !feed.problems.iter().any(|p| {
                    matches!(
                        p,
                        IdProblem::OutOfRange { .. }
                            | IdProblem::Refused { .. }
                            | IdProblem::Duplicate { .. }
                    )
                })
        })
        .map(|ids| (ids, setting))
}

/// The rule table as the README shows it (`eagle-check engines --markdown`): one row per rule,
/// generated, so the README cannot drift from the code.
pub fn markdown_table() -> String {
    let mut out = String::from(
        "| engine | targets | explicit ids | no ids | b = 0 | b = L | -1, or past L | order | ids read from | slots past b = 0 |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in RULES {
        let mut name = r.engine.name().to_string();
        if !r.path.is_empty() {
            name.push(':');
            name.push_str(r.path);
        }
        if r.since.0 != [0, 0, 0] {
            name.push('@');
            name.push_str(&r.since.to_string());
        }
        let alone = RULES
            .iter()
            .filter(|o| o.engine == r.engine && o.path == r.path && o.since == r.since)
            .count()
            == 1;
        let archs = match (r.archs.is_empty(), alone) {
            (true, true) => "any".to_string(),
            (true, false) => "any other".to_string(),
            (false, _) => r.archs.join(", "),
        };
        if let Some(why) = r.refuses {
            out.push_str(&format!(
                "| `{name}` | {archs} | refused: {why} | | | | | | | |\n"
            ));
            continue;
        }
        let mut explicit = offset_words(r.offset).to_string();
        let check = match r.check {
            IdCheck::None => "",
            IdCheck::ThreeDistinctBelowL => "; exactly 3 distinct ids in 0..L",
            IdCheck::ThreeDistinct => "; exactly 3 distinct ids >= 0",
            IdCheck::BelowL => "; ids in 0..L",
            IdCheck::DistinctUpToL => "; distinct ids in 0..=L",
            IdCheck::ThreeDistinctLayers => "; needs 3 distinct layers",
        };
        explicit.push_str(check);
        if r.strict_count {
            explicit.push_str("; raises unless every id captures");
        }
        let mut no_ids = match r.default {
            DefaultList::InputsOf => "b = [2, L//2, L-3]".to_string(),
            DefaultList::OutputsOf => "ids [1, L//2-1, L-4] -> b = [2, L//2, L-3]".to_string(),
            DefaultList::ModeloptClamped => {
                "ids sorted({1, L//2-1, L-4}), clamped at 0".to_string()
            }
            DefaultList::Refused(_) => "refused".to_string(),
        };
        if let Some(n) = r.default_raises_up_to {
            no_ids.push_str(&format!("; raises for L <= {n}"));
        }
        if r.check_default && r.offset != Offset::Ignored {
            no_ids.push_str(" (checked too)");
        }
        if r.offset == Offset::Ignored {
            no_ids = format!("{no_ids}, always");
        }
        if r.final_target {
            no_ids.push_str("; + L kept as the training target");
        }
        let minus_one = match r.minus_one {
            MinusOne::FinalPostNorm => {
                format!("-1: b = L post-norm; past L: {}", reach_words(r.outside))
            }
            MinusOne::ByOffset => reach_words(r.outside),
        };
        let order = match (r.order, r.dedup) {
            (Order::Ascending, true) => "ascending, once each",
            (Order::Ascending, false) => "ascending",
            (Order::SortedIds, _) => "sorted ids (a set; -1 first)",
            (Order::SortedIdsMinusOneLast, _) => "sorted ids (a set), -1 moved last",
        };
        let ids_from = match r.ids_from {
            IdsFrom::Nested => "`eagle_config` only".to_string(),
            IdsFrom::TopThenNested => "top level, then `eagle_config`".to_string(),
            IdsFrom::Top => "top level only".to_string(),
            IdsFrom::OverrideThenNested(o) => format!("`{o}`, then `eagle_config`"),
            IdsFrom::Setting(s) => format!("`{s}`"),
            IdsFrom::Nowhere => "nowhere".to_string(),
        };
        let captures = match r.captures {
            Capture::Residual => "the residual stream".to_string(),
            Capture::Branch(why) => format!("**no residual**: {why}"),
        };
        out.push_str(&format!(
            "| `{name}` | {archs} | {explicit} | {no_ids} | {} | {} | {minus_one} | {order} | {ids_from} | {captures} |\n",
            reach_words(r.embedding),
            reach_words(r.last),
        ));
    }
    out
}

fn reach_words(reach: Reach) -> String {
    match reach {
        Reach::Captured(Some(side)) => format!("captured {side}"),
        Reach::Captured(None) => "captured".to_string(),
        Reach::Dropped(_) => "dropped silently".to_string(),
        Reach::Crash(_) => "raises".to_string(),
        Reach::PythonIndex => "wraps (b + L); past L raises".to_string(),
    }
}
