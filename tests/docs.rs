//! The documentation: README.md is the front door and links every page of docs/; every relative
//! link of README.md and docs/*.md (and its `#anchor`) resolves; and the figures of
//! docs/figures.md that can be counted from the tree are current.
//!
//! `GENERATE=1 cargo test --test docs` (run by `make generate`) rewrites the stale counted figures
//! instead of failing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The README stays a front door: the manual lives in docs/.
const README_MAX_LINES: usize = 260;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// docs/*.md, sorted.
fn docs_pages() -> Vec<PathBuf> {
    let mut pages: Vec<PathBuf> = std::fs::read_dir(repo().join("docs"))
        .expect("docs/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    pages.sort();
    assert!(!pages.is_empty(), "docs/ has no page");
    pages
}

/// README.md and docs/*.md.
fn all_pages() -> Vec<PathBuf> {
    let mut pages = vec![repo().join("README.md")];
    pages.extend(docs_pages());
    pages
}

/// The lines of a Markdown text outside fenced code blocks, with their line numbers (from 1).
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let mut fence: Option<&str> = None;
    for (i, line) in text.lines().enumerate() {
        let t = line.trim_start();
        let marker = if t.starts_with("```") {
            Some("```")
        } else if t.starts_with("~~~") {
            Some("~~~")
        } else {
            None
        };
        match (fence, marker) {
            (None, Some(m)) => fence = Some(m),
            (Some(f), Some(m)) if f == m => fence = None,
            (None, None) => out.push((i + 1, line)),
            _ => {}
        }
    }
    out
}

/// A line without its inline code spans (`` `...` ``, ``` ``...`` ```).
fn without_code_spans(line: &str) -> String {
    let b = line.as_bytes();
    let run = |i: usize| b[i..].iter().take_while(|&&c| c == b'`').count();
    let mut out = String::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] != b'`' {
            let next = line[i..].find('`').map_or(b.len(), |n| i + n);
            out.push_str(&line[i..next]);
            i = next;
            continue;
        }
        let n = run(i);
        // The closing run: the next run of exactly n backticks.
        let mut j = i + n;
        let mut close = None;
        while j < b.len() {
            if b[j] == b'`' {
                let m = run(j);
                if m == n {
                    close = Some(j + m);
                    break;
                }
                j += m;
            } else {
                j += 1;
            }
        }
        match close {
            Some(end) => {
                out.push(' ');
                i = end;
            }
            None => {
                out.push_str(&line[i..i + n]);
                i += n;
            }
        }
    }
    out
}

/// The link targets of a Markdown text (`[text](target)`, `![alt](target)`), with line numbers.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in prose_lines(text) {
        let line = without_code_spans(line);
        let mut rest = line.as_str();
        while let Some(i) = rest.find("](") {
            let tail = &rest[i + 2..];
            let end = tail
                .find(|c: char| c == ')' || c.is_whitespace())
                .unwrap_or(tail.len());
            out.push((n, tail[..end].to_string()));
            rest = &tail[end..];
        }
    }
    out
}

/// GitHub's anchor of a heading: lower case, spaces to `-`, punctuation other than `-` and `_`
/// dropped (so `` `plan`: preview `` is `plan-preview`, `20,000 nodes` is `20000-nodes`).
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown text's headings (repeated headings get `-1`, `-2`, ...).
fn anchors(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for (_, line) in prose_lines(text) {
        let hashes = line.bytes().take_while(|&c| c == b'#').count();
        if !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let base = slug(&line[hashes..]);
        let mut anchor = base.clone();
        let mut k = 0;
        while out.contains(&anchor) {
            k += 1;
            anchor = format!("{base}-{k}");
        }
        out.push(anchor);
    }
    out
}

fn relative(path: &Path) -> String {
    path.strip_prefix(repo())
        .unwrap_or(path)
        .display()
        .to_string()
}

#[test]
fn readme_is_a_front_door() {
    let readme = read(&repo().join("README.md"));
    let lines = readme.lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, more than {README_MAX_LINES}: move reference material into a page of docs/ and link it"
    );
    for command in ["make demo", "make test"] {
        assert!(
            readme.contains(command),
            "README.md no longer shows `{command}`"
        );
    }
}

#[test]
fn every_docs_page_is_linked_from_the_readme() {
    let readme = read(&repo().join("README.md"));
    let targets: Vec<String> = links(&readme)
        .into_iter()
        .map(|(_, t)| {
            t.split('#')
                .next()
                .unwrap()
                .trim_start_matches("./")
                .to_string()
        })
        .collect();
    let missing: Vec<String> = docs_pages()
        .iter()
        .map(|p| relative(p))
        .filter(|p| !targets.contains(p))
        .collect();
    assert!(
        missing.is_empty(),
        "README.md does not link {missing:?}: add each to its Documentation table with a one-line description"
    );
}

#[test]
fn relative_links_resolve() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in all_pages() {
        let text = read(&page);
        for (line, target) in links(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (path, anchor) = match target.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (target.as_str(), None),
            };
            let file = if path.is_empty() {
                page.clone()
            } else {
                page.parent().unwrap().join(path)
            };
            let at = format!("{}:{line}: ({target})", relative(&page));
            if path.starts_with('/') || !file.exists() {
                broken.push(format!("{at}: no such file"));
                continue;
            }
            if let Some(anchor) = anchor {
                let is_markdown = file.extension().is_some_and(|e| e == "md");
                if is_markdown && !anchors(&read(&file)).iter().any(|a| a == anchor) {
                    broken.push(format!("{at}: no heading with the anchor #{anchor}"));
                }
            }
        }
    }
    assert!(checked > 30, "only {checked} relative links found");
    assert!(
        broken.is_empty(),
        "broken relative links:\n{}",
        broken.join("\n")
    );
}

/// The rows of docs/figures.md: key -> (value cell, whole line).
fn figure_rows(text: &str) -> BTreeMap<String, (String, String)> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("| `") else {
            continue;
        };
        let Some((key, rest)) = rest.split_once('`') else {
            continue;
        };
        let cells: Vec<&str> = rest.split('|').collect();
        if cells.len() < 2 {
            continue;
        }
        let previous = out.insert(
            key.to_string(),
            (cells[1].trim().to_string(), line.to_string()),
        );
        assert!(previous.is_none(), "docs/figures.md: `{key}` twice");
    }
    out
}

/// A figure row with another value (its other cells kept).
fn with_value(line: &str, value: u64) -> String {
    // "| `key` | value | ..."; the value is the cell after the key's.
    let first = line[1..].find('|').map(|i| i + 1).expect("a table row");
    let second = line[first + 1..]
        .find('|')
        .map(|i| i + first + 1)
        .unwrap_or(line.len());
    format!("{}| {value} {}", &line[..first], &line[second..])
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("entry").path())
        .collect();
    entries.sort();
    for p in entries {
        let meta = std::fs::symlink_metadata(&p).unwrap();
        if meta.is_dir() {
            files(&p, out);
        } else if meta.is_file() {
            out.push(p);
        }
    }
}

/// `#[test]` and `#[tokio::test]` functions in the Rust files under a directory.
fn test_functions(dir: &str) -> u64 {
    let mut all = Vec::new();
    files(&repo().join(dir), &mut all);
    all.iter()
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .map(|p| {
            read(p)
                .lines()
                .map(str::trim_start)
                .filter(|l| l.starts_with("#[test]") || l.starts_with("#[tokio::test"))
                .count() as u64
        })
        .sum()
}

/// Files directly in a directory whose name starts with `prefix` and ends with `suffix`.
fn count_files(dir: &str, prefix: &str, suffix: &str) -> u64 {
    std::fs::read_dir(repo().join(dir))
        .unwrap_or_else(|e| panic!("{dir}: {e}"))
        .map(|e| e.expect("entry"))
        .filter(|e| e.file_type().unwrap().is_file())
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.starts_with(prefix) && name.ends_with(suffix)
        })
        .count() as u64
}

/// Table rows (`` | `...` ``) between two markers of a page.
fn rows_between(page: &str, start: &str, end: &str) -> u64 {
    let text = read(&repo().join(page));
    let a = text
        .find(start)
        .unwrap_or_else(|| panic!("{page}: no {start}"));
    let b = text.find(end).unwrap_or_else(|| panic!("{page}: no {end}"));
    text[a..b].lines().filter(|l| l.starts_with("| `")).count() as u64
}

/// Every figure of docs/figures.md that the tree can recount, freshly counted.
fn counted_figures() -> Vec<(String, u64)> {
    let crd_fields = gpu_sharing_operator::offline::docs::crd_reference()
        .lines()
        .filter(|l| l.starts_with("| `"))
        .count() as u64;
    let mut out = vec![
        ("test-functions-src".to_string(), test_functions("src")),
        ("test-functions-tests".to_string(), test_functions("tests")),
        ("test-targets".to_string(), count_files("tests", "", ".rs")),
        (
            "e2e-test-files".to_string(),
            count_files("tests", "e2e_", ".rs"),
        ),
        (
            "examples".to_string(),
            count_files("examples", "", ".yaml") + count_files("examples", "", ".yml"),
        ),
        ("crd-fields".to_string(), crd_fields),
        (
            "chart-values".to_string(),
            rows_between(
                "docs/install.md",
                "<!-- helm-values:start -->",
                "<!-- helm-values:end -->",
            ),
        ),
        (
            "fuzz-targets".to_string(),
            count_files("fuzz/fuzz_targets", "", ".rs"),
        ),
    ];
    let mut corpora: Vec<PathBuf> = std::fs::read_dir(repo().join("fuzz/corpus"))
        .expect("fuzz/corpus")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.is_dir())
        .collect();
    corpora.sort();
    for dir in corpora {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let mut inputs = Vec::new();
        files(&dir, &mut inputs);
        out.push((format!("fuzz-corpus-{name}"), inputs.len() as u64));
    }
    out
}

#[test]
fn counted_figures_are_current() {
    let path = repo().join("docs/figures.md");
    let text = read(&path);
    let rows = figure_rows(&text);
    let mut stale = Vec::new();
    let mut missing = Vec::new();
    let mut fixed = text.clone();
    for (key, fresh) in counted_figures() {
        match rows.get(&key) {
            None => missing.push(format!(
                "`{key}` has no row; add to the table \"Counted from the tree\":\n| `{key}` | {fresh} | ... | `tests/docs.rs` |"
            )),
            Some((value, line)) if value.parse::<u64>().ok() != Some(fresh) => {
                let new = with_value(line, fresh);
                stale.push(format!(
                    "`{key}` is {value} in docs/figures.md, the tree has {fresh}; replace its row with:\n{new}"
                ));
                fixed = fixed.replacen(line.as_str(), &new, 1);
            }
            Some(_) => {}
        }
    }
    assert!(
        missing.is_empty(),
        "docs/figures.md lacks figures:\n\n{}",
        missing.join("\n\n")
    );
    if std::env::var_os("GENERATE").is_some() {
        if fixed != text {
            std::fs::write(&path, fixed).unwrap();
        }
        return;
    }
    assert!(
        stale.is_empty(),
        "docs/figures.md is stale (or run `GENERATE=1 cargo test --test docs`):\n\n{}",
        stale.join("\n\n")
    );
}

/// Numbers of a text (`1,664` -> `1664`; `1304s` -> `1304`), not parts of decimals, versions or
/// identifiers.
fn numbers(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let b = text.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let glued =
            i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'.' || b[i - 1] == b'_');
        if !b[i].is_ascii_digit() || glued {
            i += 1;
            continue;
        }
        let mut j = i;
        while j < b.len()
            && (b[j].is_ascii_digit()
                || (b[j] == b','
                    && b.get(j + 1..j + 4)
                        .is_some_and(|d| d.iter().all(u8::is_ascii_digit))))
        {
            j += 1;
        }
        let decimal = b.get(j) == Some(&b'.') && b.get(j + 1).is_some_and(u8::is_ascii_digit);
        if !decimal {
            out.push(text[i..j].replace(',', ""));
        }
        while j < b.len() && (b[j].is_ascii_alphanumeric() || b[j] == b'.') {
            j += 1;
        }
        i = j;
    }
    out
}

/// The figures live in docs/figures.md only: another page quoting one (and then going stale, as
/// the README's `make test` time and conformance counts did) links to it instead. Small values
/// (below 1000) are left out: they collide with unrelated numbers.
#[test]
fn figures_are_not_repeated_elsewhere() {
    let figures = figure_rows(&read(&repo().join("docs/figures.md")));
    let mut repeated = Vec::new();
    for page in all_pages() {
        if page.ends_with("docs/figures.md") {
            continue;
        }
        let found = numbers(&read(&page));
        for (key, (value, _)) in &figures {
            if value.parse::<u64>().is_ok_and(|v| v >= 1000) && found.contains(value) {
                repeated.push(format!("{} quotes `{key}` ({value})", relative(&page)));
            }
        }
    }
    assert!(
        repeated.is_empty(),
        "link to docs/figures.md instead of repeating its figures:\n{}",
        repeated.join("\n")
    );
}

#[test]
fn the_link_and_number_parsers() {
    assert_eq!(
        links("see [a](docs/a.md#x) and `[b](nope.md)` and ![c](img.png)\n```\n[d](e.md)\n```"),
        vec![(1, "docs/a.md#x".to_string()), (1, "img.png".to_string())]
    );
    assert_eq!(
        anchors(
            "# A\n## `plan`: preview it\n### 20,000 nodes x 200 policies\n## A\n```\n# not\n```"
        ),
        vec!["a", "plan-preview-it", "20000-nodes-x-200-policies", "a-1"]
    );
    assert_eq!(
        numbers("took 1841 s, 1,664 cases; 108.3 MiB, v0.19.1, x86_64 and 1304s"),
        vec!["1841", "1664", "1304"]
    );
    assert_eq!(
        with_value("| `examples` | 7 | example files | `tests/docs.rs` |", 8),
        "| `examples` | 8 | example files | `tests/docs.rs` |"
    );
}

/// The test files that need the local control plane or a tool built from Go (they start a
/// `TestCluster`, go through `tests/support`'s `setup`, or run `tests/tools/build.sh`).
fn needs_cluster_or_tools(text: &str) -> bool {
    [
        "TestCluster",
        "setup(",
        "setup_with",
        "tests/tools/build.sh",
    ]
    .iter()
    .any(|m| text.contains(m))
}

/// The `[[test]]` targets of Cargo.toml that run only with `--features e2e`.
fn gated_tests(manifest: &str) -> Vec<String> {
    manifest
        .split("[[test]]")
        .skip(1)
        .filter(|t| {
            let t = t.split("\n[").next().unwrap_or(t);
            t.contains("required-features = [\"e2e\"]")
        })
        .filter_map(|t| {
            let line = t.lines().find(|l| l.starts_with("name = "))?;
            Some(
                line.trim_start_matches("name = ")
                    .trim_matches('"')
                    .to_string(),
            )
        })
        .collect()
}

/// Plain `cargo test` stays Rust-only and fast: every test file that needs the control plane
/// or a Go tool is a `[[test]]` target behind the `e2e` feature (`make test` passes it).
#[test]
fn tests_needing_a_cluster_or_go_tools_are_behind_the_e2e_feature() {
    let gated = gated_tests(&read(&repo().join("Cargo.toml")));
    let mut missing = vec![];
    let mut files = std::fs::read_dir(repo().join("tests"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .collect::<Vec<_>>();
    files.sort();
    for f in files {
        let name = f.file_stem().unwrap().to_string_lossy().to_string();
        if name == "docs" {
            continue; // this file names the markers it looks for
        }
        let needs = name.starts_with("e2e_") || needs_cluster_or_tools(&read(&f));
        if needs && !gated.contains(&name) {
            missing.push(name);
        }
    }
    assert!(
        missing.is_empty(),
        "these tests start a control plane or build Go tools but run in plain `cargo test`; \
         give each a [[test]] entry with required-features = [\"e2e\"] in Cargo.toml: {missing:?}"
    );
    // The check itself: a file that starts a cluster and has no entry is caught.
    assert!(needs_cluster_or_tools(
        "let c = TestCluster::shared().await;"
    ));
    assert!(gated_tests("[[test]]\nname = \"x\"\npath = \"tests/x.rs\"\n").is_empty());
    assert_eq!(
        gated_tests(
            "[[test]]\nname = \"x\"\npath = \"tests/x.rs\"\nrequired-features = [\"e2e\"]\n"
        ),
        ["x"]
    );
}
