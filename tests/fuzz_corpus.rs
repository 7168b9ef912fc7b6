//! The fuzz corpus replayed without fuzzing: every file under `fuzz/corpus/<target>/` goes
//! through the entry point its fuzz target calls (`eagle_check::fuzzing`), on stable, so CI
//! catches a regression on any input the fuzzer ever kept without a nightly toolchain. Crashes
//! the fuzzer found are pinned below as named regression tests.

use crate::support::root;
use eagle_check::fuzzing::TARGETS;

#[test]
fn every_corpus_file_goes_through_its_entry_point_without_panicking() {
    let corpus = root().join("fuzz").join("corpus");
    let mut replayed = 0;
    for (name, entry) in TARGETS {
        let dir = corpus.join(name);
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.expect("corpus entry").path())
            .collect();
        files.sort();
        assert!(!files.is_empty(), "{}: empty corpus", dir.display());
        for file in files {
            let bytes = std::fs::read(&file).expect("corpus file");
            // A panic here names the file: replay it with `cargo fuzz run <target> <file>`.
            eprintln!("{name}: {}", file.display());
            entry(&bytes);
            replayed += 1;
        }
    }
    assert!(replayed >= TARGETS.len(), "{replayed}");
}
