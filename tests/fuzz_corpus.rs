//! The fuzz targets (issue 16, part 3) on stable Rust, in `make test`: every input of the kept
//! corpora (`fuzz/corpus/<target>/`) replayed, then a seeded smoke run of mutations of them, with
//! the same checks as `cargo fuzz` (fuzz/src/lib.rs). The rendering cases are written to
//! `target/fuzz-cases/` for the conformance suite, which loads what render printed with NVIDIA's
//! parsers and checks that every refusal names a field (tests/nvidia/conformance.sh).

#[path = "../fuzz/src/lib.rs"]
#[allow(dead_code)]
mod fuzz;

use std::path::{Path, PathBuf};

use arbitrary::{Arbitrary, Unstructured};
use fuzz::Verdict;

fn corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("entry").path())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).expect("readable"))
        })
        .collect()
}

fn cases_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target"));
    target.join("fuzz-cases")
}

/// SplitMix64: the smoke run's inputs are the same on every machine.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// A libFuzzer-like mutation of one input: bytes flipped, inserted, removed or spliced in from
/// another corpus input.
fn mutate(rng: &mut Rng, data: &[u8], corpus: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut d = data.to_vec();
    for _ in 0..1 + rng.below(4) {
        match rng.below(4) {
            0 if !d.is_empty() => {
                let i = rng.below(d.len());
                d[i] ^= 1 << rng.below(8);
            }
            1 => {
                let i = rng.below(d.len() + 1);
                d.insert(i, rng.next() as u8);
            }
            2 if !d.is_empty() => {
                let i = rng.below(d.len());
                let n = rng.below(16).min(d.len() - i);
                d.drain(i..i + n);
            }
            _ => {
                let other = &corpus[rng.below(corpus.len())].1;
                if !other.is_empty() {
                    let a = rng.below(other.len());
                    let b = (a + rng.below(64)).min(other.len());
                    let i = rng.below(d.len() + 1);
                    d.splice(i..i, other[a..b].iter().copied());
                }
            }
        }
    }
    d
}

#[derive(Default, Debug)]
struct Tally {
    rendered: usize,
    refused: usize,
    skipped: usize,
}
impl Tally {
    fn add(&mut self, v: Verdict) {
        match v {
            Verdict::Rendered => self.rendered += 1,
            Verdict::Refused => self.refused += 1,
            Verdict::Skipped => self.skipped += 1,
        }
    }
}

/// Replays the corpus of `target`, then `smoke` seeded mutations of it (a few hundred: the
/// debug build of `make test` runs about 30x slower than the fuzzer's).
fn replay(target: &str, smoke: usize, check: impl Fn(&[u8]) -> Verdict) -> Tally {
    let corpus = corpus(target);
    assert!(
        corpus.len() >= 8,
        "{target}: the corpus is kept in the repository"
    );
    let mut tally = Tally::default();
    for (_, data) in &corpus {
        tally.add(check(data));
    }
    let mut rng = Rng(0x6770_7573_6861_7265 ^ target.len() as u64);
    for _ in 0..smoke {
        let base = &corpus[rng.below(corpus.len())].1;
        tally.add(check(&mutate(&mut rng, base, &corpus)));
    }
    eprintln!(
        "{target}: {} corpus inputs + {smoke} mutations: {tally:?}",
        corpus.len()
    );
    tally
}

fn structured<'a, T: Arbitrary<'a>>(data: &'a [u8]) -> Option<T> {
    T::arbitrary_take_rest(Unstructured::new(data)).ok()
}

#[test]
fn policy_yaml_corpus_and_smoke() {
    let t = replay("policy_yaml", 400, fuzz::policy_yaml);
    assert!(t.rendered > 0 && t.refused > 0, "{t:?}");
    // Conformance: every corpus input, as it is.
    let dir = cases_dir().join("policy_yaml");
    let _ = std::fs::remove_dir_all(&dir);
    for (name, data) in corpus("policy_yaml") {
        if let Ok(text) = std::str::from_utf8(&data) {
            fuzz::write_cases(&dir, &name, text, None).expect("writable");
        }
    }
}

#[test]
fn render_mutated_corpus_and_smoke() {
    let t = replay("render_mutated", 100, |d| {
        structured::<fuzz::Mutated>(d).map_or(Verdict::Skipped, |c| fuzz::render_mutated(&c))
    });
    assert!(t.rendered > 0 && t.refused > 0, "{t:?}");
    let dir = cases_dir().join("render_mutated");
    let _ = std::fs::remove_dir_all(&dir);
    for (name, data) in corpus("render_mutated") {
        if let Some(c) = structured::<fuzz::Mutated>(&data) {
            let (policies, nodes) = fuzz::mutated_files(&c);
            fuzz::write_cases(&dir, &name, &policies, nodes.as_deref()).expect("writable");
        }
    }
}

#[test]
fn plan_labels_corpus_and_smoke() {
    let t = replay("plan_labels", 100, |d| {
        structured::<fuzz::Labelled>(d).map_or(Verdict::Skipped, |c| fuzz::plan_labels(&c))
    });
    assert!(t.rendered > 0, "{t:?}");
}

/// The shared inputs are what the targets assume: the examples valid together, the nodes readable.
#[test]
fn examples_and_nodes_render_together() {
    let all: String = fuzz::EXAMPLES
        .iter()
        .map(|(_, t)| format!("---\n{t}\n"))
        .collect();
    assert_eq!(
        fuzz::check_render(&all, Some(fuzz::NODES)),
        Verdict::Rendered
    );
    for (name, text) in fuzz::EXAMPLES {
        assert_eq!(
            fuzz::check_render(text, Some(fuzz::NODES)),
            Verdict::Rendered,
            "{name}"
        );
    }
}
