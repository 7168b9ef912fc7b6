//! Layout classification: how one list of boundaries differs from another, as one finding
//! name and a sentence. The gate (what an engine feeds vs the spec), the diff (what captures
//! hold vs the spec, and vs inference) and the probe all name layout faults through here.

use crate::boundary::{Boundary, format_list};
use crate::report::FindingName;

/// How `got` differs from `want`, with the two sides named in the message (`("fed", "trained
/// on")`, `("captured", "spec")`). `None` when they are equal.
pub fn classify(
    got: &[Boundary],
    want: &[Boundary],
    words: (&str, &str),
) -> Option<(FindingName, String)> {
    if got == want {
        return None;
    }
    let both = format!(
        "{} {}, {} {}",
        words.0,
        format_list(got),
        words.1,
        format_list(want)
    );
    let got_emb = got.contains(&Boundary::EMBEDDING);
    let want_emb = want.contains(&Boundary::EMBEDDING);
    if got_emb != want_emb {
        let msg = if got_emb {
            format!(
                "the embedding output (b = 0) takes an fc slot that training never gave it: {both}"
            )
        } else {
            format!("training held the embedding output (b = 0), which is missing here: {both}")
        };
        return Some((FindingName::EmbeddingCapture, msg));
    }
    if got.len() != want.len() {
        return Some((
            FindingName::Count,
            format!(
                "{} slots where {} are expected: {both}",
                got.len(),
                want.len()
            ),
        ));
    }
    let mut got_sorted = got.to_vec();
    let mut want_sorted = want.to_vec();
    got_sorted.sort();
    want_sorted.sort();
    if got_sorted == want_sorted {
        return Some((
            FindingName::Order,
            format!("the same boundaries in another order: {both}"),
        ));
    }
    // One apart: every slot that differs is one boundary off, all the same way. Users read
    // "layer ids one apart" as off-by-one whether it hit every slot or some (the slots are named).
    let deltas: Vec<i64> = got
        .iter()
        .zip(want)
        .map(|(a, b)| a.0 as i64 - b.0 as i64)
        .collect();
    let off: Vec<usize> = (0..deltas.len()).filter(|&i| deltas[i] != 0).collect();
    let first = deltas[off[0]];
    if first.abs() == 1 && off.iter().all(|&i| deltas[i] == first) {
        let side = if first > 0 { "above" } else { "below" };
        let which = if off.len() == deltas.len() {
            "every slot is".to_string()
        } else {
            let slots: Vec<String> = off.iter().map(|s| s.to_string()).collect();
            format!(
                "slot{} {} {}",
                if off.len() > 1 { "s" } else { "" },
                slots.join(", "),
                if off.len() > 1 { "are" } else { "is" }
            )
        };
        return Some((
            FindingName::OffByOne,
            format!("{which} one boundary {side} the expected one: {both}"),
        ));
    }
    Some((FindingName::WrongLayer, both))
}

/// The slots where `got` and `want` differ (the whole list when their lengths differ).
pub fn differing_slots(got: &[Boundary], want: &[Boundary]) -> Vec<usize> {
    if got.len() != want.len() {
        return (0..got.len().max(want.len())).collect();
    }
    (0..got.len()).filter(|&i| got[i] != want[i]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bs(v: &[usize]) -> Vec<Boundary> {
        v.iter().map(|&b| Boundary(b)).collect()
    }

    #[test]
    fn layouts_are_classified() {
        let c = |f: &[usize], w: &[usize]| classify(&bs(f), &bs(w), ("fed", "spec")).map(|x| x.0);
        assert_eq!(c(&[2, 30, 58], &[2, 30, 58]), None);
        assert_eq!(
            c(&[0, 3, 31], &[3, 31, 59]),
            Some(FindingName::EmbeddingCapture)
        );
        assert_eq!(
            c(&[2, 30, 58], &[0, 2, 30, 58]),
            Some(FindingName::EmbeddingCapture)
        );
        assert_eq!(c(&[1, 29, 57], &[2, 30, 58]), Some(FindingName::OffByOne));
        assert_eq!(c(&[3, 31, 59], &[2, 30, 58]), Some(FindingName::OffByOne));
        assert_eq!(c(&[30, 2, 58], &[2, 30, 58]), Some(FindingName::Order));
        assert_eq!(c(&[2, 30], &[2, 30, 58]), Some(FindingName::Count));
        assert_eq!(c(&[2, 31, 58], &[2, 30, 58]), Some(FindingName::OffByOne));
        assert_eq!(c(&[2, 32, 58], &[2, 30, 58]), Some(FindingName::WrongLayer));
        // One slot one above, another one below: not "one apart" in one direction.
        assert_eq!(c(&[3, 29, 58], &[2, 30, 58]), Some(FindingName::WrongLayer));
    }

    #[test]
    fn partial_off_by_one_names_its_slots() {
        let (_, msg) =
            classify(&bs(&[2, 31, 58]), &bs(&[2, 30, 58]), ("captured", "spec")).unwrap();
        assert!(msg.starts_with("slot 1 is one boundary above"), "{msg}");
        assert_eq!(
            differing_slots(&bs(&[2, 31, 58]), &bs(&[2, 30, 58])),
            vec![1]
        );
    }
}
