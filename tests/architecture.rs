//! The module layout is a rule, not a habit: every module of `src/` may depend only on the
//! modules below it, so that the flow reads one way (api <- nvidia <- validate <- plan <-
//! runtime / offline <- preview; telemetry beside, depending on api only). This test reads the sources and
//! fails on any `crate::` path that goes back up or sideways.

use std::collections::BTreeMap;
use std::path::Path;

/// What each top-level module may use, besides itself.
fn allowed() -> BTreeMap<&'static str, &'static [&'static str]> {
    [
        ("api", &[][..]),
        ("nvidia", &["api"][..]),
        ("validate", &["api", "nvidia"][..]),
        ("plan", &["api", "nvidia", "validate"][..]),
        ("telemetry", &["api"][..]),
        (
            "runtime",
            &["api", "nvidia", "validate", "plan", "telemetry"][..],
        ),
        ("offline", &["api", "nvidia", "validate", "plan"][..]),
        (
            "preview",
            &["api", "nvidia", "validate", "plan", "runtime"][..],
        ),
    ]
    .into()
}

/// The top-level modules a source text names through `crate::`.
fn crate_refs(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // `use crate::{a::x, b};`
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let name: String = item
                    .trim()
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    out.push(name);
                }
            }
        } else {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                out.push(name);
            }
        }
    }
    out
}

fn visit(dir: &Path, files: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            visit(&p, files);
        } else if p.extension().is_some_and(|x| x == "rs") {
            files.push(p);
        }
    }
}

#[test]
fn modules_depend_one_way() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let allowed = allowed();
    let mut files = Vec::new();
    visit(&src, &mut files);
    let mut violations = Vec::new();
    let mut checked = 0;
    for f in files {
        let rel = f.strip_prefix(&src).unwrap();
        let mut parts = rel.components();
        let first = parts.next().unwrap().as_os_str().to_str().unwrap();
        // lib.rs, main.rs and src/bin/ are the entry points: they may use everything.
        if parts.next().is_none() || first == "bin" {
            continue;
        }
        let may = allowed
            .get(first)
            .unwrap_or_else(|| panic!("src/{first}/ is not in the layout: add it to this test"));
        checked += 1;
        let text = std::fs::read_to_string(&f).unwrap();
        for r in crate_refs(&text) {
            if r != first && !may.contains(&r.as_str()) {
                violations.push(format!("{}: uses crate::{r}", rel.display()));
            }
        }
    }
    assert!(checked >= 10, "only {checked} files checked");
    assert!(
        violations.is_empty(),
        "imports that go against the layout:\n{}",
        violations.join("\n")
    );
}

#[test]
fn the_reference_scanner_sees_every_form() {
    assert_eq!(
        crate_refs(
            "use crate::plan::{a, b};\nuse crate::{api::names, nvidia};\nx = crate::runtime::f();"
        ),
        ["plan", "api", "nvidia", "runtime"]
    );
}
