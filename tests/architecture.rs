//! The house's shape (ARCHITECTURE.md), checked over the `use` lines of `src/`: every module
//! belongs to a wing, no module imports from a higher wing, the units (the entries of
//! [`WINGS`]) form no circle, no command imports another, and the files inside a unit form no
//! circle either. Test modules (`#[cfg(test)] mod ... { }`) are left out: a kernel's test may
//! compare against the model's CPU code. `kernels/cuda.rs` holds only the launch machinery:
//! each op's launch arguments and launch live in its room. Each test here plants the edge (or
//! the launch) it guards against.

use crate::support::root;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The wings, lowest first; each lists its units (module paths). A module belongs to the unit
/// that is its longest prefix. Imports go to the same wing or a lower one.
const WINGS: &[(&str, &[&str])] = &[
    // Bytes on disk into typed values; depends on nothing of ours.
    ("formats", &["readers"]),
    // The error type, which carries the readers' typed errors, and the byte sizes its messages
    // print: they depend on nothing else.
    ("errors", &["error", "size"]),
    // Shared vocabulary: boundary indices, sizes, the report and its renderings, progress,
    // tolerances, statistics, the scoring arithmetic the diff and the GPU share.
    (
        "base",
        &[
            "boundary",
            "stats",
            "naming",
            "tolerance",
            "compare",
            "score",
            "report",
            "ci",
            "memory",
            "progress",
        ],
    ),
    // config.json / the spec's target resolved; MoE routing (`routing`) beside it.
    ("config", &["config", "routing"]),
    // Where the model files are and what their headers say (safetensors, GGUF), tokenizers.
    ("files", &["weights", "locate", "tokenize"]),
    // What each engine and trainer does (the rule table), and the capture spec.
    ("rules", &["engine", "spec"]),
    // Judge once: classify a fed layout, check a feed, invert a rule into a fix.
    ("judge", &["judge"]),
    // GPU ops and their CPU references.
    ("kernels", &["kernels"]),
    // The models: loading, forwards, captures.
    ("model", &["model"]),
    // The diff engine: reference states and the identification of captured slots.
    ("diff", &["diff"]),
    // The commands, and what they share (`commands` itself).
    (
        "commands",
        &[
            "commands",
            "commands::gate",
            "commands::run",
            "commands::diff",
            "commands::probe",
            "commands::plan",
            "commands::spec_init",
            "commands::engines",
        ],
    ),
    // The fuzz targets' entry points.
    ("harness", &["fuzzing"]),
];

/// Known back-edges, each to be removed: (from module, to module, why). The test fails when
/// one is no longer there, so that its line is deleted with it.
const EXCEPTIONS: &[(&str, &str, &str)] = &[];

/// One module's file: `src/a/b.rs` or `src/a/b/mod.rs` is `a::b`.
fn module_of(rel: &Path) -> String {
    let mut parts: Vec<String> = rel
        .with_extension("")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts.join("::")
}

/// Source with comments, string and char literals blanked (so `"crate::x"` or a `{` in a
/// string is not code).
fn code_only(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    while i < b.len() {
        let c = b[i];
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            let mut depth = 0;
            while i < b.len() {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if (c == b'r' || c == b'b')
            && (i == 0 || !ident(b[i - 1]))
            && raw_string_len(&b[i..]).is_some()
        {
            i += raw_string_len(&b[i..]).unwrap_or(1);
            out.push_str("\"\"");
        } else if c == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == b'\'' && i + 2 < b.len() && (b[i + 1] == b'\\' || b[i + 2] == b'\'') {
            // A char literal ('x', '\n', '\u{..}'); a lifetime ('a) has no closing quote.
            let mut j = i + 2;
            while j < b.len() && b[j] != b'\'' {
                j += 1;
            }
            i = j + 1;
            out.push_str("' '");
        } else {
            let len = src[i..].chars().next().map_or(1, char::len_utf8);
            out.push_str(&src[i..i + len]);
            i += len;
        }
    }
    out
}

/// The length of a raw (or byte) string literal starting here (`r"..."`, `r#"..."#`, `br".."`,
/// `b"..."`), if one does.
fn raw_string_len(b: &[u8]) -> Option<usize> {
    let mut i = 0;
    if b.first() == Some(&b'b') {
        i += 1;
    }
    let raw = b.get(i) == Some(&b'r');
    if raw {
        i += 1;
    }
    if !raw && i == 0 {
        return None;
    }
    let hashes = b[i..].iter().take_while(|&&c| c == b'#').count();
    if !raw && hashes > 0 {
        return None;
    }
    i += hashes;
    if b.get(i) != Some(&b'"') {
        return None;
    }
    i += 1;
    if !raw {
        while i < b.len() && b[i] != b'"' {
            i += if b[i] == b'\\' { 2 } else { 1 };
        }
        return Some(i + 1);
    }
    let close: Vec<u8> = std::iter::once(b'"').chain(vec![b'#'; hashes]).collect();
    (i..b.len())
        .find(|&j| b[j..].starts_with(&close))
        .map(|j| j + close.len())
}

/// `code` without its `#[cfg(test)] mod name { ... }` blocks.
fn without_test_modules(code: &str) -> String {
    let mut out = String::new();
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at + "#[cfg(test)]".len()..];
        let trimmed = after.trim_start();
        let is_block_mod = trimmed
            .strip_prefix("pub(crate) ")
            .unwrap_or(trimmed)
            .strip_prefix("mod ")
            .and_then(|m| m.find(['{', ';']).map(|k| m.as_bytes()[k] == b'{'))
            .unwrap_or(false);
        if !is_block_mod {
            out.push_str("#[cfg(test)]");
            rest = after;
            continue;
        }
        let open = after.find('{').unwrap_or(0);
        let mut depth = 0usize;
        let mut end = after.len();
        for (k, ch) in after[open..].char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + k + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// Every path a file names: the leaves of its `use` trees and each `crate::`/`super::` path
/// in its code, as segments.
fn paths_in(code: &str) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    let words = |s: &str| -> Vec<String> {
        s.split("::")
            .map(|w| w.trim().to_string())
            .filter(|w| !w.is_empty())
            .collect()
    };
    fn leaves(prefix: &[String], tree: &str, out: &mut Vec<Vec<String>>) {
        let tree = tree.trim();
        match tree.find('{') {
            None => {
                let name = tree.split(" as ").next().unwrap_or("").trim();
                let mut p = prefix.to_vec();
                p.extend(
                    name.split("::")
                        .map(str::trim)
                        .filter(|w| !w.is_empty() && *w != "self" && *w != "*")
                        .map(String::from),
                );
                out.push(p);
            }
            Some(open) => {
                let mut p = prefix.to_vec();
                p.extend(
                    tree[..open]
                        .split("::")
                        .map(str::trim)
                        .filter(|w| !w.is_empty())
                        .map(String::from),
                );
                let body = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
                let (mut depth, mut start) = (0usize, 0usize);
                for (k, ch) in body.char_indices() {
                    match ch {
                        '{' => depth += 1,
                        '}' => depth -= 1,
                        ',' if depth == 0 => {
                            leaves(&p, &body[start..k], out);
                            start = k + 1;
                        }
                        _ => {}
                    }
                }
                leaves(&p, &body[start..], out);
            }
        }
    }
    let bytes = code.as_bytes();
    let is_ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut k = 0;
    while let Some(at) = code[k..].find("use ") {
        let s = k + at;
        k = s + 4;
        if s > 0 && is_ident(bytes[s - 1]) {
            continue;
        }
        if let Some(end) = code[s..].find(';') {
            leaves(&[], &code[s + 4..s + end], &mut paths);
        }
    }
    for root in ["crate::", "super::"] {
        let mut k = 0;
        while let Some(at) = code[k..].find(root) {
            let s = k + at;
            k = s + root.len();
            if s > 0 && (is_ident(bytes[s - 1]) || bytes[s - 1] == b':') {
                continue;
            }
            let end = code[s..]
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                .map_or(code.len(), |e| s + e);
            paths.push(words(&code[s..end]));
        }
    }
    paths
}

/// Module -> the modules it imports (not its ancestors or descendants), from `src/`, with the
/// source of any module replaced as `planted` says (for the tests that plant an edge).
fn import_graph(planted: &[(&str, &str)]) -> BTreeMap<String, BTreeSet<String>> {
    let src = root().join("src");
    let mut files = Vec::new();
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    let mut modules: BTreeMap<String, String> = BTreeMap::new();
    for file in files {
        let name = module_of(file.strip_prefix(&src).unwrap());
        // The binary (main.rs, cli.rs) and the library root only declare and dispatch.
        if ["lib", "main", "cli"].contains(&name.as_str()) {
            continue;
        }
        modules.insert(name, std::fs::read_to_string(&file).unwrap());
    }
    for (module, extra) in planted {
        modules
            .entry(module.to_string())
            .or_default()
            .push_str(extra);
    }
    let names: BTreeSet<String> = modules.keys().cloned().collect();
    let mut graph = BTreeMap::new();
    for (module, text) in &modules {
        let me: Vec<String> = module.split("::").map(String::from).collect();
        let code = without_test_modules(&code_only(text));
        let mut deps = BTreeSet::new();
        for path in paths_in(&code) {
            let full: Vec<String> = match path.first().map(String::as_str) {
                Some("crate") => path[1..].to_vec(),
                Some("super") => {
                    let ups = path.iter().take_while(|w| *w == "super").count();
                    let mut base = me[..me.len().saturating_sub(ups)].to_vec();
                    base.extend_from_slice(&path[ups..]);
                    base
                }
                // A child module of this one, named relatively (`use layout::X` in a mod.rs).
                Some(first) if names.contains(&format!("{module}::{first}")) => {
                    let mut p = me.clone();
                    p.extend_from_slice(&path);
                    p
                }
                _ => continue,
            };
            let Some(target) = (1..=full.len())
                .rev()
                .map(|n| full[..n].join("::"))
                .find(|m| names.contains(m))
            else {
                continue;
            };
            let related = target == *module
                || module.starts_with(&format!("{target}::"))
                || target.starts_with(&format!("{module}::"));
            if !related {
                deps.insert(target);
            }
        }
        graph.insert(module.clone(), deps);
    }
    graph
}

/// The unit (an entry of [`WINGS`]) and wing index a module belongs to.
fn unit_of(module: &str) -> Option<(&'static str, usize)> {
    WINGS
        .iter()
        .enumerate()
        .flat_map(|(w, (_, units))| units.iter().map(move |u| (*u, w)))
        .filter(|(u, _)| module == *u || module.starts_with(&format!("{u}::")))
        .max_by_key(|(u, _)| u.len())
}

/// A circle in `graph`, as the modules along it, if there is one.
fn circle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(node.to_string(), 1);
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            match state.get(next.as_str()) {
                Some(1) => {
                    let from = path.iter().position(|p| p == next).unwrap_or(0);
                    let mut c = path[from..].to_vec();
                    c.push(next.clone());
                    return Some(c);
                }
                Some(_) => {}
                None => {
                    if let Some(c) = visit(next, graph, state, path) {
                        return Some(c);
                    }
                }
            }
        }
        path.pop();
        state.insert(node.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for node in graph.keys() {
        if !state.contains_key(node.as_str())
            && let Some(c) = visit(node, graph, &mut state, &mut Vec::new())
        {
            return Some(c);
        }
    }
    None
}

/// Every way the graph breaks the house's rules, one line each.
fn violations(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let mut problems = Vec::new();
    let excepted = |a: &str, b: &str| EXCEPTIONS.iter().any(|(x, y, _)| *x == a && *y == b);
    let mut units: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut inside: BTreeMap<&str, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for (module, deps) in graph {
        let Some((unit, wing)) = unit_of(module) else {
            problems.push(format!(
                "{module} belongs to no wing (add it to WINGS and ARCHITECTURE.md)"
            ));
            continue;
        };
        units.entry(unit.to_string()).or_default();
        for dep in deps {
            if excepted(module, dep) {
                continue;
            }
            let Some((dep_unit, dep_wing)) = unit_of(dep) else {
                continue;
            };
            if dep_wing > wing {
                problems.push(format!(
                    "{module} ({}) imports {dep} ({}), a higher wing",
                    WINGS[wing].0, WINGS[dep_wing].0
                ));
            }
            if WINGS[wing].0 == "commands"
                && unit != "commands"
                && dep_unit != "commands"
                && dep_unit != unit
                && dep_wing == wing
            {
                problems.push(format!("command {unit} imports command {dep_unit}"));
            }
            if dep_unit == unit {
                inside
                    .entry(unit)
                    .or_default()
                    .entry(module.clone())
                    .or_default()
                    .insert(dep.clone());
            } else {
                units
                    .entry(unit.to_string())
                    .or_default()
                    .insert(dep_unit.to_string());
            }
        }
    }
    if let Some(c) = circle(&units) {
        problems.push(format!("a circle between units: {}", c.join(" -> ")));
    }
    for (unit, files) in inside {
        if let Some(c) = circle(&files) {
            problems.push(format!("a circle inside {unit}: {}", c.join(" -> ")));
        }
    }
    for (from, to, why) in EXCEPTIONS {
        if !graph.get(*from).is_some_and(|d| d.contains(*to)) {
            problems.push(format!(
                "the exception {from} -> {to} ({why}) is gone: delete its line"
            ));
        }
    }
    problems
}

#[test]
fn the_wings_hold_no_circle_and_no_upward_import() {
    let problems = violations(&import_graph(&[]));
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The check sees the edges the issue named: plant each again and watch it fail.
#[test]
fn a_planted_back_edge_fails() {
    for (module, line, needle) in [
        (
            "error",
            "use crate::memory::peak_rss;",
            "error (errors) imports memory (base), a higher wing",
        ),
        (
            "progress",
            "use crate::diff::reference::RefStates;",
            "a higher wing",
        ),
        (
            "kernels::score",
            "use crate::diff::identify::SlotId;",
            "kernels::score (kernels) imports diff::identify",
        ),
        (
            "locate",
            "fn f() { crate::model::gguf::open_gguf(x); }",
            "locate (files) imports model::gguf",
        ),
        (
            "commands::probe",
            "use crate::commands::spec_init::trainer;",
            "command commands::probe imports command commands::spec_init",
        ),
        (
            "diff::reference",
            "use super::dump_ref::DumpReference;",
            "a circle inside diff",
        ),
        (
            "kernels::moe",
            "use crate::model::moe::MoeBlock;",
            "kernels::moe (kernels) imports model::moe (model), a higher wing",
        ),
    ] {
        let problems = violations(&import_graph(&[(module, line)]));
        assert!(
            problems.iter().any(|p| p.contains(needle)),
            "planting `{line}` in {module}: {problems:?}"
        );
    }
}

#[test]
fn test_modules_strings_and_comments_are_not_imports() {
    let code = code_only(
        "// use crate::model;\nlet s = \"crate::diff::x\"; let c = '{';\n\
         #[cfg(test)]\nmod tests {\n    use crate::model::nn;\n    fn f() { let _ = \"}\"; }\n}\nuse crate::report::Report;\n",
    );
    let paths = paths_in(&without_test_modules(&code));
    let report = vec!["crate".to_string(), "report".into(), "Report".into()];
    assert!(
        !paths.is_empty() && paths.iter().all(|p| *p == report),
        "{paths:?}"
    );
}

/// What `kernels/cuda.rs` holds that belongs in an op's room (`kernels::X::launch`), one line
/// each: a launch-arguments struct (`*Args`), a `launch!` of a kernel, or a kernel looked up
/// (`function(..)`). The loader, the macro's definition, allocation and device set-up stay.
fn launches_in_cuda_rs(src: &str) -> Vec<String> {
    let code = without_test_modules(&code_only(src));
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut problems = Vec::new();
    for (n, line) in code.lines().enumerate() {
        let words: Vec<&str> = line
            .split(|c: char| !is_ident(c))
            .filter(|w| !w.is_empty())
            .collect();
        if let Some(w) = words
            .windows(2)
            .find(|w| w[0] == "struct" && w[1].ends_with("Args"))
        {
            problems.push(format!(
                "line {}: struct {} (launch arguments)",
                n + 1,
                w[1]
            ));
        }
        let squeezed: String = line.chars().filter(|c| !c.is_whitespace()).collect();
        if squeezed.contains("launch!(") {
            problems.push(format!("line {}: a kernel launch", n + 1));
        }
        // A call, not the definition (`fn function(` squeezes to `fnfunction(`).
        let looked_up = squeezed
            .match_indices("function(")
            .any(|(at, _)| !squeezed[..at].ends_with(is_ident));
        if looked_up {
            problems.push(format!("line {}: a kernel looked up", n + 1));
        }
    }
    problems
}

#[test]
fn kernel_launches_live_in_their_rooms() {
    let src = std::fs::read_to_string(root().join("src/kernels/cuda.rs")).unwrap();
    let problems = launches_in_cuda_rs(&src);
    assert!(
        problems.is_empty(),
        "kernels/cuda.rs holds what belongs in an op's room (kernels::X::launch):\n{}",
        problems.join("\n")
    );
    for (plant, needle) in [
        (
            "pub struct RopeArgs {\n    pub x: DevPtr,\n}\n",
            "struct RopeArgs",
        ),
        (
            "fn f(dev: &CudaDevice) -> Result<()> {\n    let func = function(dev, Module::Rope, \"rope_f32\")?;\n    launch!(dev, func, \"rope_f32\", cfg((1, 1, 1), 32, 0)?, [0u64]);\n    Ok(())\n}\n",
            "a kernel launch",
        ),
        (
            "fn f(dev: &CudaDevice) -> Result<CudaFunction> {\n    function(dev, Module::Rope, \"rope_f32\")\n}\n",
            "a kernel looked up",
        ),
    ] {
        let problems = launches_in_cuda_rs(&format!("{src}\n{plant}"));
        assert!(
            problems.iter().any(|p| p.contains(needle)),
            "planting `{plant}` in kernels/cuda.rs: {problems:?}"
        );
    }
}
