//! The module layout is a rule, not a habit: every module of `src/` may depend only on the
//! modules below it, so that the flow reads one way (api <- nvidia <- validate <- plan <-
//! runtime / offline <- preview; telemetry beside, depending on api only). This test reads the sources and
//! fails on any path into the crate that goes back up or sideways.
//!
//! The sources are read with a small tokenizer (comments, string, raw-string, byte-string and
//! char literals skipped; lifetimes told apart from chars), not with text search, and every path
//! that starts at `crate`, `$crate`, `super` or `self` is resolved against the module it is
//! written in: the file's module (`src/plan/node.rs` is `crate::plan::node`, `src/plan/mod.rs`
//! is `crate::plan`) plus any inline `mod x { .. }` around it (`#[cfg(test)] mod tests`).
//! Paths are read wherever they stand: `use` trees of any shape (`pub use`, `pub(crate) use`,
//! nested `{..}` groups, `self`, `as` renames, globs) and inline in code
//! (`crate::plan::plan(..)`, `super::super::Labels`, types, macros).
//! A path to the crate root itself (`use super::*;` in `src/api/mod.rs`) is a violation too: the
//! names it brings in would then hide which module they come from.
//!
//! The same reading of paths checks the files inside each folder (no import cycle between
//! siblings such as `plan/node.rs` and `plan/vm.rs`), and the module diagram in `src/lib.rs`
//! is checked against [`allowed`] below. Functions longer than 100 lines are refused too.

use std::collections::BTreeMap;
use std::path::Path;

/// What each top-level module may use, besides itself.
fn allowed() -> BTreeMap<&'static str, &'static [&'static str]> {
    [
        ("api", &[][..]),
        ("nvidia", &["api"][..]),
        ("validate", &["api", "nvidia"][..]),
        ("plan", &["api", "nvidia", "validate"][..]),
        // A model of NVIDIA's components answering a plan: for `plan`, `render` and the bench.
        ("converge", &["api", "nvidia", "validate", "plan"][..]),
        ("observe", &["api", "nvidia", "validate", "plan"][..]),
        ("telemetry", &["api"][..]),
        (
            "runtime",
            &["api", "nvidia", "validate", "plan", "observe", "telemetry"][..],
        ),
        (
            "offline",
            &["api", "nvidia", "validate", "plan", "observe", "converge"][..],
        ),
        (
            "preview",
            &[
                "api", "nvidia", "validate", "plan", "observe", "runtime", "converge",
            ][..],
        ),
    ]
    .into()
}

// ---------------------------------------------------------------------------------------------
// Tokenizer

#[derive(Debug, Clone, PartialEq)]
enum Kind {
    /// An identifier or keyword (a raw identifier `r#x` without its `r#`).
    Ident,
    /// `::` or a single punctuation character.
    Punct,
    /// A string, char or number literal (its text is not kept), or a lifetime.
    Lit,
}

#[derive(Debug, Clone)]
struct Tok {
    kind: Kind,
    text: String,
    line: usize,
}

fn is_ident_start(c: char) -> bool {
    c == '_' || c.is_alphabetic()
}

fn is_ident_char(c: char) -> bool {
    c == '_' || c.is_alphanumeric()
}

/// Rust source text as tokens, without comments; literals become one `Lit` token each.
fn tokenize(src: &str) -> Vec<Tok> {
    let c: Vec<char> = src.chars().collect();
    let at = |k: usize| c.get(k).copied().unwrap_or('\0');
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    let lit = |line: usize| Tok {
        kind: Kind::Lit,
        text: String::new(),
        line,
    };
    while i < c.len() {
        let ch = c[i];
        let start_line = line;
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && at(i + 1) == '/' {
            // Line comments, doc comments included.
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && at(i + 1) == '*' {
            // Block comments nest.
            let mut depth = 1;
            i += 2;
            while i < c.len() && depth > 0 {
                if c[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                } else {
                    if c[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
            }
        } else if let Some(end) = raw_string_end(&c, i) {
            // r"..", r#".."#, br#".."#, cr".."
            line += c[i..end].iter().filter(|&&x| x == '\n').count();
            i = end;
            out.push(lit(start_line));
        } else if ch == '"' || ((ch == 'b' || ch == 'c') && at(i + 1) == '"') {
            // "..", b"..", c"..": escapes skipped, so an escaped quote does not end it.
            i += if ch == '"' { 1 } else { 2 };
            while i < c.len() && c[i] != '"' {
                if c[i] == '\\' {
                    i += 1;
                }
                if at(i) == '\n' {
                    line += 1;
                }
                i += 1;
            }
            i += 1;
            out.push(lit(start_line));
        } else if ch == '\'' || (ch == 'b' && at(i + 1) == '\'') {
            // 'x', '\n', '\u{..}', b'x' -- or a lifetime / label 'a.
            if ch == 'b' {
                i += 1;
            }
            if at(i + 1) == '\\' {
                i += 3; // the quote, the backslash, the escaped char (maybe a quote)
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3;
            } else {
                i += 1;
                while i < c.len() && is_ident_char(c[i]) {
                    i += 1;
                }
            }
            out.push(lit(start_line));
        } else if is_ident_start(ch) {
            let mut s = i;
            if ch == 'r' && at(i + 1) == '#' && is_ident_start(at(i + 2)) {
                s = i + 2; // raw identifier r#type
            }
            i = s;
            while i < c.len() && is_ident_char(c[i]) {
                i += 1;
            }
            out.push(Tok {
                kind: Kind::Ident,
                text: c[s..i].iter().collect(),
                line,
            });
        } else if ch.is_ascii_digit() {
            // 1, 0x1f, 1_000u32, 1.5e3 (but not the `.` of `x.0.1` or of a range `0..n`)
            while i < c.len()
                && (is_ident_char(c[i]) || (c[i] == '.' && at(i + 1).is_ascii_digit()))
            {
                i += 1;
            }
            out.push(lit(start_line));
        } else if ch == ':' && at(i + 1) == ':' {
            out.push(Tok {
                kind: Kind::Punct,
                text: "::".into(),
                line,
            });
            i += 2;
        } else {
            out.push(Tok {
                kind: Kind::Punct,
                text: ch.to_string(),
                line,
            });
            i += 1;
        }
    }
    out
}

/// If a raw string literal starts at `i`, the index just after it.
fn raw_string_end(c: &[char], i: usize) -> Option<usize> {
    let at = |k: usize| c.get(k).copied().unwrap_or('\0');
    let mut j = i;
    if (at(j) == 'b' || at(j) == 'c') && at(j + 1) == 'r' {
        j += 1;
    }
    if at(j) != 'r' {
        return None;
    }
    j += 1;
    let mut hashes = 0;
    while at(j) == '#' {
        hashes += 1;
        j += 1;
    }
    if at(j) != '"' {
        return None; // an identifier, or a raw identifier r#x
    }
    j += 1;
    while j < c.len() {
        if c[j] == '"' && (1..=hashes).all(|h| at(j + h) == '#') {
            return Some(j + 1 + hashes);
        }
        j += 1;
    }
    Some(c.len())
}

// ---------------------------------------------------------------------------------------------
// Paths

/// A path into the crate found in a file.
#[derive(Debug, Clone, PartialEq)]
struct Ref {
    line: usize,
    /// As written (a `use` tree item with its group prefixes), e.g. `super::super::runtime::Y`.
    written: String,
    /// Resolved from the crate root, e.g. `["runtime", "Y"]`; empty for the crate root itself;
    /// `Err` when it cannot resolve (`super` above the crate root).
    target: Result<Vec<String>, String>,
}

/// Whether a path's first segment makes it a path into this crate.
fn is_crate_anchor(seg: &str) -> bool {
    matches!(seg, "crate" | "$crate" | "super" | "self")
}

/// `segs` (starting at `crate`, `$crate`, `super` or `self`) written inside `module`, resolved
/// from the crate root.
fn resolve(module: &[String], segs: &[String]) -> Result<Vec<String>, String> {
    let mut path: Vec<String> = match segs[0].as_str() {
        "crate" | "$crate" => Vec::new(),
        _ => module.to_vec(),
    };
    let rest = if matches!(segs[0].as_str(), "crate" | "$crate") {
        &segs[1..]
    } else {
        segs
    };
    for s in rest {
        match s.as_str() {
            "super" => {
                if path.pop().is_none() {
                    return Err("`super` goes above the crate root".into());
                }
            }
            "self" | "*" => {}
            "crate" | "$crate" => return Err("`crate` in the middle of a path".into()),
            _ => path.push(s.clone()),
        }
    }
    Ok(path)
}

struct Parser {
    toks: Vec<Tok>,
    i: usize,
}

impl Parser {
    fn is(&self, k: usize, text: &str) -> bool {
        self.toks
            .get(self.i + k)
            .is_some_and(|t| t.kind != Kind::Lit && t.text == text)
    }

    fn ident(&self, k: usize) -> Option<&Tok> {
        self.toks.get(self.i + k).filter(|t| t.kind == Kind::Ident)
    }

    /// A path segment here (`$crate` and other `$x` metavariables count as one), consumed.
    fn segment(&mut self) -> Option<(String, usize)> {
        if let Some(t) = self.ident(0) {
            let r = (t.text.clone(), t.line);
            self.i += 1;
            Some(r)
        } else if self.is(0, "$") && self.ident(1).is_some() {
            let t = self.ident(1).unwrap();
            let r = (format!("${}", t.text), t.line);
            self.i += 2;
            Some(r)
        } else {
            None
        }
    }

    /// One path or `use` tree from here; every complete path it names goes to `out` (a group
    /// `a::{b, c::{d, self}}` names `a::b`, `a::c::d` and `a::c`). In a `use` tree `as x` is
    /// consumed; in code it is left alone (it is a cast).
    fn tree(&mut self, prefix: Vec<String>, in_use: bool, out: &mut Vec<(Vec<String>, usize)>) {
        let mut path = prefix;
        let mut line = self.toks.get(self.i).map_or(0, |t| t.line);
        if in_use && path.is_empty() && self.is(0, "::") {
            self.i += 1;
            path.push("::".into()); // `use ::other_crate::x;`: never this crate
        }
        loop {
            if self.is(0, "{") {
                self.i += 1;
                while self.i < self.toks.len() && !self.is(0, "}") && !self.is(0, ";") {
                    let before = self.i;
                    self.tree(path.clone(), in_use, out);
                    if self.is(0, ",") {
                        self.i += 1;
                    } else if self.i == before {
                        self.i += 1; // something unexpected: never loop on it
                    }
                }
                if self.is(0, "}") {
                    self.i += 1;
                }
                return;
            }
            if self.is(0, "*") {
                self.i += 1;
                path.push("*".into());
                out.push((path, line));
                return;
            }
            let Some((seg, l)) = self.segment() else {
                if !path.is_empty() {
                    out.push((path, line));
                }
                return;
            };
            path.push(seg);
            line = l;
            if self.is(0, "::") {
                self.i += 1;
                continue;
            }
            if in_use && self.is(0, "as") {
                self.i += 2;
            }
            out.push((path, line));
            return;
        }
    }
}

/// Every path into the crate in the source text of the module `module` (e.g. `["plan", "node"]`
/// for `src/plan/node.rs`), resolved.
fn references(module: &[String], text: &str) -> Vec<Ref> {
    let mut p = Parser {
        toks: tokenize(text),
        i: 0,
    };
    let mut out = Vec::new();
    // Inline modules around the current token: name, and the brace depth inside them.
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    while p.i < p.toks.len() {
        let mut found = Vec::new();
        if p.is(0, "{") {
            depth += 1;
            p.i += 1;
            continue;
        }
        if p.is(0, "}") {
            depth = depth.saturating_sub(1);
            if inline.last().is_some_and(|(_, d)| *d > depth) {
                inline.pop();
            }
            p.i += 1;
            continue;
        }
        if p.is(0, "mod") && p.ident(1).is_some() && p.is(2, "{") {
            depth += 1;
            inline.push((p.ident(1).unwrap().text.clone(), depth));
            p.i += 3;
            continue;
        }
        let prev_is = |t: &str, k: usize| {
            p.i >= k
                && p.toks
                    .get(p.i - k)
                    .is_some_and(|x| x.kind != Kind::Lit && x.text == t)
        };
        if p.is(0, "use") && p.toks[p.i].kind == Kind::Ident && !p.is(1, "<") {
            // `use`, `pub use`, `pub(crate) use`, in any block (not `impl Trait + use<'a>`).
            p.i += 1;
            p.tree(Vec::new(), true, &mut found);
        } else if (p.ident(0).is_some_and(|t| is_crate_anchor(&t.text)) && p.is(1, "::")
            || p.is(0, "$") && p.ident(1).is_some_and(|t| t.text == "crate") && p.is(2, "::"))
            && !prev_is("::", 1)
        {
            // Inline: `crate::plan::plan(..)`, `super::super::Labels`, `$crate::api::x!()`.
            // `pub(in crate::x)` only restricts visibility (to an ancestor): not a dependency.
            let visibility = prev_is("in", 1) && prev_is("(", 2) && prev_is("pub", 3);
            p.tree(Vec::new(), false, &mut found);
            if visibility {
                found.clear();
            }
        } else {
            p.i += 1;
        }
        let mut here = module.to_vec();
        here.extend(inline.iter().map(|(m, _)| m.clone()));
        for (segs, line) in found {
            if !is_crate_anchor(&segs[0]) {
                continue; // std::.., another crate, or a name in scope (its `use` is checked)
            }
            out.push(Ref {
                line,
                written: segs.join("::"),
                target: resolve(&here, &segs),
            });
        }
    }
    out
}

/// The module a file under `src/` is: `plan/node.rs` -> `plan::node`, `plan/mod.rs` -> `plan`.
fn module_of(rel: &str) -> Vec<String> {
    let mut m: Vec<String> = rel
        .trim_end_matches(".rs")
        .split('/')
        .map(String::from)
        .collect();
    if m.last().is_some_and(|x| x == "mod") {
        m.pop();
    }
    m
}

/// The layout violations of one file, `rel` being its path under `src/` (`/`-separated).
fn check(rel: &str, text: &str) -> Vec<String> {
    let module = module_of(rel);
    let top = module[0].as_str();
    let allowed = allowed();
    let Some(may) = allowed.get(top) else {
        return vec![format!(
            "src/{rel}: src/{top}/ is not in the layout: add it to tests/architecture.rs"
        )];
    };
    let mut violations = Vec::new();
    for r in references(&module, text) {
        let why = match &r.target {
            Err(e) => Some(e.clone()),
            Ok(t) if t.is_empty() => Some("names the crate root itself".into()),
            Ok(t) if t[0] != top && !may.contains(&t[0].as_str()) => {
                Some(format!("reaches crate::{} from {top}", t.join("::")))
            }
            Ok(_) => None,
        };
        if let Some(why) = why {
            violations.push(format!("src/{rel}:{}: `{}` {why}", r.line, r.written));
        }
    }
    violations
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
    let mut files = Vec::new();
    visit(&src, &mut files);
    files.sort();
    let mut violations = Vec::new();
    let mut checked = 0;
    let mut refs = 0;
    for f in files {
        let rel = f.strip_prefix(&src).unwrap();
        let rel: Vec<&str> = rel.iter().map(|c| c.to_str().unwrap()).collect();
        // lib.rs, main.rs and src/bin/ are the entry points: they may use everything.
        if rel.len() == 1 || rel[0] == "bin" {
            continue;
        }
        let rel = rel.join("/");
        let text = std::fs::read_to_string(&f).unwrap();
        assert!(
            !text.contains("#[path"),
            "src/{rel}: #[path] moves modules where this test cannot follow"
        );
        checked += 1;
        refs += references(&module_of(&rel), &text).len();
        violations.extend(check(&rel, &text));
    }
    assert!(checked >= 10, "only {checked} files checked");
    assert!(refs >= 100, "only {refs} paths into the crate found");
    assert!(
        violations.is_empty(),
        "imports that go against the layout:\n{}",
        violations.join("\n")
    );
}

// ---------------------------------------------------------------------------------------------
// The checker itself

fn targets(module: &str, text: &str) -> Vec<String> {
    let module: Vec<String> = module.split("::").map(String::from).collect();
    references(&module, text)
        .into_iter()
        .map(|r| match r.target {
            Ok(t) => format!("crate::{}", t.join("::")),
            Err(e) => e,
        })
        .collect()
}

#[test]
fn use_trees_are_read_whole() {
    assert_eq!(
        targets(
            "api::x",
            "use crate::{plan::{node::{X, self as n}, rollout::*}, api};\n\
             pub use crate::nvidia::Y as Z;\n\
             pub(crate) use self::inner::W;\n\
             pub(super) use super::{self as parent, names::*};\n\
             use {crate::validate::V, std::fmt};\n\
             use ::serde::Deserialize;\n\
             fn f() -> impl Sized + use<> {}"
        ),
        [
            "crate::plan::node::X",
            "crate::plan::node",
            "crate::plan::rollout",
            "crate::api",
            "crate::nvidia::Y",
            "crate::api::x::inner::W",
            "crate::api",
            "crate::api::names",
            "crate::validate::V",
        ]
    );
}

#[test]
fn super_and_self_resolve_against_the_file_and_inline_modules() {
    // src/plan/node.rs is crate::plan::node: `super` is crate::plan.
    assert_eq!(targets("plan::node", "use super::X;"), ["crate::plan::X"]);
    // src/plan/mod.rs is crate::plan: `super` is the crate root.
    assert_eq!(module_of("plan/mod.rs"), ["plan"]);
    assert_eq!(module_of("plan/node.rs"), ["plan", "node"]);
    assert_eq!(targets("plan", "use super::api::X;"), ["crate::api::X"]);
    // Inline modules count, and end at their closing brace.
    assert_eq!(
        targets(
            "plan::node",
            "fn a() { if x { self::b() } }\n\
             #[cfg(test)]\nmod tests {\n  use super::*;\n  fn t() { let _: super::super::Labels = g(); }\n  \
             mod deeper { use super::super::super::super::runtime::R; }\n}\n\
             use self::c;"
        ),
        [
            "crate::plan::node::b",
            "crate::plan::node",
            "crate::plan::Labels",
            "crate::runtime::R",
            "crate::plan::node::c",
        ]
    );
    assert_eq!(
        targets("api", "use super::super::x;"),
        ["`super` goes above the crate root"]
    );
}

#[test]
fn inline_paths_are_found_and_comments_and_literals_are_not() {
    assert_eq!(
        targets(
            "preview::diff",
            r###"
            // use crate::telemetry::A;
            /// crate::telemetry::B in a doc comment
            /* crate::telemetry::C /* nested */ crate::telemetry::D */
            let s = "crate::telemetry::E \" crate::telemetry::F";
            let r = r#"crate::telemetry::G " still raw"#;
            let b = br"crate::telemetry::H";
            let q = '"'; let e = '\''; let l: &'static str = "";
            let x = crate::runtime::apply::f::<u8>(crate::plan::Plan { a: 1 }) as crate::api::T;
            let r#type = 1;
            macro_rules! m { () => { $crate::nvidia::emit() } }
            pub(in crate::preview) fn g() {}
            let y = Self::new(); let z = self.0; let w = other::crate_like::x;
            "###
        ),
        [
            "crate::runtime::apply::f",
            "crate::plan::Plan",
            "crate::api::T",
            "crate::nvidia::emit",
        ]
    );
}

#[test]
fn the_checker_catches_a_back_import_written_each_way() {
    // Each of these makes src/api/ depend on a module above it.
    let bad = [
        ("api/x.rs", "use crate::{plan::{node::X}, api};"),
        (
            "api/x.rs",
            "use crate::{\n    api::names,\n    plan::node::{self},\n};",
        ),
        ("api/x.rs", "use super::super::runtime::Y;"),
        ("api/mod.rs", "pub(crate) use super::runtime::Y;"),
        (
            "api/x.rs",
            "mod tests { use super::super::super::runtime::Y; }",
        ),
        ("api/x.rs", "fn f() { crate::runtime::foo(); }"),
        ("api/x.rs", "fn f() -> super::super::plan::Plan { todo!() }"),
        ("api/x.rs", "pub use crate::validate as v;"),
        ("api/x.rs", "use crate::telemetry::*;"),
        (
            "api/x.rs",
            "macro_rules! m { () => { $crate::runtime::f() } }",
        ),
        // The crate root itself: its glob would bring every module in unseen.
        (
            "api/mod.rs",
            "#[cfg(test)]\nmod tests { use super::super::*; }",
        ),
        ("api/mod.rs", "use super::*;"),
        // Sideways: telemetry depends on api only.
        ("telemetry/metrics.rs", "use crate::plan::Plan;"),
        ("offline/render.rs", "let r = crate::runtime::apply::x;"),
    ];
    for (rel, text) in bad {
        let v = check(rel, text);
        assert_eq!(v.len(), 1, "src/{rel}: {text:?} gave {v:?}");
        println!("{}", v[0]);
    }
    assert_eq!(
        check("api/x.rs", "\n\nuse crate::{api, plan::P};"),
        ["src/api/x.rs:3: `crate::plan::P` reaches crate::plan::P from api"]
    );
    assert_eq!(
        check("api/x.rs", "use super::super::runtime::Y;"),
        ["src/api/x.rs:1: `super::super::runtime::Y` reaches crate::runtime::Y from api"]
    );
    assert!(check("newmod/x.rs", "")[0].contains("not in the layout"));
}

#[test]
fn the_checker_accepts_legal_imports() {
    let good = [
        (
            "api/x.rs",
            "use crate::api::names::{self, *};\nuse super::state::S;",
        ),
        // In src/api/x.rs `super::runtime` is crate::api::runtime, not crate::runtime.
        ("api/x.rs", "use super::runtime::Y;"),
        (
            "api/x.rs",
            "mod tests { use super::super::runtime::Y; use super::*; }",
        ),
        (
            "api/x.rs",
            "// use crate::runtime::X;\nlet s = \"crate::runtime::x\";",
        ),
        (
            "api/x.rs",
            "use std::{fmt, collections::BTreeMap}; use serde::Serialize;",
        ),
        (
            "nvidia/mod.rs",
            "use crate::{api::names, nvidia::mig}; use super::api::X;",
        ),
        (
            "plan/node.rs",
            "use super::super::validate::V; let l: super::Labels;",
        ),
        (
            "runtime/apply.rs",
            "use crate::{api, nvidia, validate, plan::Plan, telemetry::m};",
        ),
        (
            "preview/diff.rs",
            "let c = crate::runtime::controller::run();",
        ),
        ("telemetry/metrics.rs", "use crate::api::names::X;"),
    ];
    for (rel, text) in good {
        assert_eq!(
            check(rel, text),
            Vec::<String>::new(),
            "src/{rel}: {text:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Files inside a folder

/// Every file under `src/` but the entry points (lib.rs, main.rs, src/bin/), as its path under
/// `src/` (`/`-separated) and its text, in path order.
fn sources() -> Vec<(String, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    visit(&src, &mut files);
    files.sort();
    files
        .into_iter()
        .filter_map(|f| {
            let rel = f.strip_prefix(&src).unwrap();
            let rel: Vec<&str> = rel.iter().map(|c| c.to_str().unwrap()).collect();
            if rel.len() == 1 || rel[0] == "bin" {
                return None;
            }
            Some((rel.join("/"), std::fs::read_to_string(&f).unwrap()))
        })
        .collect()
}

/// One edge of the file graph: a path that file uses into a sibling file.
#[derive(Debug, Clone)]
struct FileEdge {
    /// Where, e.g. `src/plan/node.rs:27: super::vm`.
    at: String,
}

/// The import graph between sibling files: `plan/node -> plan/vm` when `src/plan/node.rs` uses
/// a path into `crate::plan::vm` (its first such path is kept, to show). A folder's `mod.rs` is
/// the folder's module itself (`crate::plan`), not one of its files: a path to what it declares
/// (`super::NodeFacts`) is no edge, and its own paths (`self::node::X`) are not edges between
/// files either. The module a path reaches is the longest module prefix of it that is a file.
fn file_graph(files: &[(String, String)]) -> BTreeMap<String, BTreeMap<String, FileEdge>> {
    let modules: std::collections::BTreeSet<Vec<String>> =
        files.iter().map(|(rel, _)| module_of(rel)).collect();
    let mut graph: BTreeMap<String, BTreeMap<String, FileEdge>> = BTreeMap::new();
    // A folder's mod.rs is a file among its siblings too (`plan/mod`): a sibling that takes a
    // name from it and a mod.rs that re-exports or calls the sibling make a cycle.
    let node = |m: &[String], is_mod: bool| {
        if is_mod {
            format!("{}/mod", m.join("/"))
        } else {
            m.join("/")
        }
    };
    for (rel, text) in files {
        let module = module_of(rel);
        let is_mod = rel.ends_with("/mod.rs");
        if module.len() < 2 && !is_mod {
            continue; // a top-level file: not a file among siblings
        }
        // The folder whose files are this file's siblings.
        let folder: &[String] = if is_mod {
            &module
        } else {
            &module[..module.len() - 1]
        };
        for r in references(&module, text) {
            let Ok(target) = &r.target else { continue };
            let Some(to) = (1..=target.len())
                .rev()
                .map(|k| target[..k].to_vec())
                .find(|m| modules.contains(m))
            else {
                continue;
            };
            // A name of the folder's own mod.rs, or a sibling file. A path through a module
            // that is no file (`plan::gone::X`) names nothing here.
            let to_mod = to == folder;
            let through_unknown = target.len() > to.len() + 1
                && target[to.len()].starts_with(|c: char| c.is_ascii_lowercase());
            if to_mod && through_unknown {
                continue;
            }
            let sibling = to.len() == folder.len() + 1 && to[..folder.len()] == *folder;
            let itself = if to_mod { is_mod } else { to == module };
            if itself || !to_mod && !sibling {
                continue;
            }
            graph
                .entry(node(&module, is_mod))
                .or_default()
                .entry(node(&to, to_mod))
                .or_insert(FileEdge {
                    at: format!(
                        "src/{rel}:{}: {}",
                        r.line,
                        r.written.trim_end_matches("::self")
                    ),
                });
        }
    }
    graph
}

/// The import cycles of a file graph, each as its files in order, with the edges that close
/// it; cycles of strongly connected files (two files that reach each other are in one).
fn file_cycles(graph: &BTreeMap<String, BTreeMap<String, FileEdge>>) -> Vec<String> {
    let reach = |from: &str| {
        let mut seen = std::collections::BTreeSet::new();
        let mut todo = vec![from.to_string()];
        while let Some(v) = todo.pop() {
            for w in graph.get(&v).into_iter().flat_map(|e| e.keys()) {
                if seen.insert(w.clone()) {
                    todo.push(w.clone());
                }
            }
        }
        seen
    };
    let mut done = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for v in graph.keys() {
        if done.contains(v) {
            continue;
        }
        let comp: Vec<&String> = reach(v)
            .iter()
            .filter_map(|w| graph.keys().find(|k| *k == w))
            .filter(|w| reach(w).contains(v))
            .collect();
        if comp.is_empty() {
            continue; // v does not reach itself
        }
        done.extend(comp.iter().map(|w| w.to_string()));
        let names: Vec<&str> = comp.iter().map(|w| w.as_str()).collect();
        let mut text = format!("cycle: {}", names.join(" <-> "));
        for a in &comp {
            for (b, e) in &graph[*a] {
                if comp.contains(&b) {
                    text.push_str(&format!("\n    {a} -> {b}  ({})", e.at));
                }
            }
        }
        out.push(text);
    }
    out
}

/// Inside every folder of `src/` the files depend one way too (as `python3 filecycles.py src`
/// checks): a cycle such as `plan/node <-> plan/vm` means neither file can be read, tested or
/// moved without the other. Test modules count (a test's import is an import).
#[test]
fn files_inside_a_folder_depend_one_way() {
    let files = sources();
    let graph = file_graph(&files);
    let edges: usize = graph.values().map(BTreeMap::len).sum();
    assert!(
        edges >= 20,
        "only {edges} edges between sibling files found"
    );
    let cycles = file_cycles(&graph);
    assert!(
        cycles.is_empty(),
        "import cycles between the files of a folder (move what both sides need into a leaf \
         file, or the consumer on top):\n{}",
        cycles.join("\n")
    );
}

#[test]
fn the_file_checker_finds_cycles_through_any_path() {
    let f = |rel: &str, text: &str| (rel.to_string(), text.to_string());
    let files = [
        f("plan/mod.rs", "use self::vm::X; pub struct Facts;"),
        f("plan/node.rs", "use super::{Facts, vm::{self}};"),
        f(
            "plan/vm.rs",
            "fn t() { crate::plan::rollout::Entry::new(); }",
        ),
        f(
            "plan/rollout.rs",
            "mod tests { use super::super::node::decide; }",
        ),
        f("plan/facts.rs", "use super::Facts;"),
        f("runtime/apply.rs", "use crate::plan::node::X;"),
    ];
    let graph = file_graph(&files);
    assert_eq!(
        file_cycles(&graph),
        [
            "cycle: plan/mod <-> plan/node <-> plan/rollout <-> plan/vm\n    \
          plan/mod -> plan/vm  (src/plan/mod.rs:1: self::vm::X)\n    \
          plan/node -> plan/mod  (src/plan/node.rs:1: super::Facts)\n    \
          plan/node -> plan/vm  (src/plan/node.rs:1: super::vm)\n    \
          plan/rollout -> plan/node  (src/plan/rollout.rs:1: super::super::node::decide)\n    \
          plan/vm -> plan/rollout  (src/plan/vm.rs:1: crate::plan::rollout::Entry::new)"
        ]
    );
    // mod.rs counts: it re-exports vm, which takes a name from it.
    let hub = [files[0].clone(), f("plan/vm.rs", "use super::Facts;")];
    assert_eq!(
        file_cycles(&file_graph(&hub)),
        ["cycle: plan/mod <-> plan/vm\n    \
          plan/mod -> plan/vm  (src/plan/mod.rs:1: self::vm::X)\n    \
          plan/vm -> plan/mod  (src/plan/vm.rs:1: super::Facts)"]
    );
    // One way (other folders are not files among plan's siblings): no cycle.
    let one_way = [
        files[0].clone(),
        files[1].clone(),
        files[2].clone(),
        files[4].clone(),
    ];
    assert_eq!(file_cycles(&file_graph(&one_way)), Vec::<String>::new());
}

// ---------------------------------------------------------------------------------------------
// Function length

/// Every `fn` with a body in a source text: its name, first line and length in lines, from the
/// line of `fn` to the line of its closing brace (attributes and doc comments not counted;
/// braces in comments and literals do not count, the tokenizer skips them).
fn function_lengths(text: &str) -> Vec<(String, usize, usize)> {
    let toks = tokenize(text);
    let mut out = Vec::new();
    for (i, t) in toks.iter().enumerate() {
        let named = toks.get(i + 1).is_some_and(|n| n.kind == Kind::Ident);
        if t.kind != Kind::Ident || t.text != "fn" || !named {
            continue; // not `fn name` (e.g. the pointer type `fn(u8)`)
        }
        // The body is the first `{` outside parentheses and brackets; `;` first: no body.
        let mut j = i + 2;
        let mut depth = 0i32;
        while let Some(x) = toks.get(j) {
            match x.text.as_str() {
                "(" | "[" => depth += 1,
                ")" | "]" => depth -= 1,
                "{" | ";" if depth == 0 => break,
                _ => {}
            }
            j += 1;
        }
        if toks.get(j).is_none_or(|x| x.text != "{") {
            continue;
        }
        let mut braces = 0;
        for x in &toks[j..] {
            match (x.kind == Kind::Punct, x.text.as_str()) {
                (true, "{") => braces += 1,
                (true, "}") => {
                    braces -= 1;
                    if braces == 0 {
                        out.push((toks[i + 1].text.clone(), t.line, x.line - t.line + 1));
                        break;
                    }
                }
                _ => {}
            }
        }
    }
    out
}

/// The longest a function may be, in lines.
const MAX_FN_LINES: usize = 100;

/// No function in `src/` (the modules; the entry points lib.rs, main.rs and src/bin/ aside) is
/// longer than [`MAX_FN_LINES`], unit tests included: a longer one does several things that
/// deserve names.
#[test]
fn no_function_is_longer_than_the_limit() {
    let mut all = Vec::new();
    for (rel, text) in sources() {
        for (name, line, lines) in function_lengths(&text) {
            all.push((lines, format!("src/{rel}:{line}: fn {name}")));
        }
    }
    assert!(all.len() >= 500, "only {} functions found", all.len());
    all.sort_by(|a, b| b.cmp(a));
    println!("longest: {} ({} lines)", all[0].1, all[0].0);
    let over: Vec<String> = all
        .iter()
        .filter(|(n, _)| *n > MAX_FN_LINES)
        .map(|(n, f)| format!("{f}: {n} lines"))
        .collect();
    assert!(
        over.is_empty(),
        "functions longer than {MAX_FN_LINES} lines (split them):\n{}",
        over.join("\n")
    );
}

#[test]
fn function_lengths_count_from_fn_to_the_closing_brace() {
    let text = "/// doc\n#[test]\nfn a() {\n    let s = \"}\"; // }\n    if x { y(); }\n}\n\
                pub(crate) async fn b<T>(f: fn(u8) -> [u8; 2]) -> impl Fn() where T: X {\n}\n\
                trait T { fn c(&self); fn d() { '}'; } }\n";
    assert_eq!(
        function_lengths(text),
        [
            ("a".to_string(), 3, 4),
            ("b".to_string(), 7, 2),
            ("d".to_string(), 9, 1)
        ]
    );
}

// ---------------------------------------------------------------------------------------------
// The crate's documented layout

/// The `pub mod` names of `src/lib.rs`.
fn lib_modules(lib: &str) -> Vec<String> {
    let mut m: Vec<String> = lib
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub mod ")?.strip_suffix(';'))
        .map(|m| m.trim().to_string())
        .collect();
    m.sort();
    m
}

/// What the doc comment of `src/lib.rs` says of the modules: the diagram's lines (`plan ->
/// api, nvidia, validate`; `-> (none)` for no dependency), each module with what it may use,
/// and the modules its list describes (`- [`plan`]: ...`). Errors name the line they reject.
#[allow(clippy::type_complexity)]
fn documented_layout(lib: &str) -> Result<(BTreeMap<String, Vec<String>>, Vec<String>), String> {
    let doc: Vec<&str> = lib
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("//!"))
        .map(str::trim)
        .collect();
    let start = doc
        .iter()
        .position(|l| *l == "```text")
        .ok_or("no ```text diagram in the doc comment")?;
    let len = doc[start + 1..]
        .iter()
        .position(|l| *l == "```")
        .ok_or("the ```text diagram does not end")?;
    let mut diagram = BTreeMap::new();
    for line in doc[start + 1..start + 1 + len]
        .iter()
        .filter(|l| !l.is_empty())
    {
        let (module, deps) = line.split_once("->").ok_or(format!(
            "diagram line {line:?} is not `module -> dependencies`"
        ))?;
        let deps: Vec<String> = match deps.trim() {
            "(none)" => Vec::new(),
            d => d.split(',').map(|x| x.trim().to_string()).collect(),
        };
        if diagram.insert(module.trim().to_string(), deps).is_some() {
            return Err(format!("the diagram has {} twice", module.trim()));
        }
    }
    let mut listed: Vec<String> = doc
        .iter()
        .filter_map(|l| l.strip_prefix("- [`")?.split_once("`]"))
        .map(|(m, _)| m.to_string())
        .collect();
    listed.sort();
    Ok((diagram, listed))
}

/// The problems of the doc comment of `src/lib.rs` against its `pub mod`s and [`allowed`].
fn layout_doc_problems(lib: &str) -> Vec<String> {
    let modules = lib_modules(lib);
    let (diagram, listed) = match documented_layout(lib) {
        Ok(d) => d,
        Err(e) => return vec![e],
    };
    let allowed = allowed();
    let mut problems = Vec::new();
    for m in &modules {
        if !diagram.contains_key(m) {
            problems.push(format!("module {m} is missing from the diagram"));
        }
        if !listed.contains(m) {
            problems.push(format!(
                "module {m} is missing from the list (- [`{m}`]: ...)"
            ));
        }
    }
    for (m, deps) in &diagram {
        if !modules.contains(m) {
            problems.push(format!(
                "the diagram names {m}, which is no `pub mod` of lib.rs"
            ));
            continue;
        }
        let mut want: Vec<String> = allowed
            .get(m.as_str())
            .map_or(&[][..], |d| *d)
            .iter()
            .map(|d| d.to_string())
            .collect();
        let mut have = deps.clone();
        want.sort();
        have.sort();
        if have != want {
            problems.push(format!(
                "the diagram says {m} -> {}, tests/architecture.rs allows {m} -> {}",
                deps.join(", "),
                want.join(", ")
            ));
        }
    }
    for m in listed.iter().filter(|m| !modules.contains(m)) {
        problems.push(format!(
            "the list names {m}, which is no `pub mod` of lib.rs"
        ));
    }
    problems
}

/// The module diagram in `src/lib.rs` is the layout this file enforces: every `pub mod` is in
/// it with exactly the modules [`allowed`] lets it use, and in the list below it; neither names
/// a module that does not exist.
#[test]
fn the_crate_doc_shows_every_module_and_its_dependencies() {
    let lib =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs")).unwrap();
    assert!(lib_modules(&lib).len() >= 8, "{:?}", lib_modules(&lib));
    let problems = layout_doc_problems(&lib);
    assert!(
        problems.is_empty(),
        "src/lib.rs's doc comment does not match the layout:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_crate_doc_check_catches_a_missing_or_unknown_module() {
    let lib = "//! ```text\n//! api -> (none)\n//! nvidia -> api\n//! ghost -> api\n//! ```\n\
               //!\n//! - [`api`]: names.\n//! - [`ghost`]: gone.\n\n\
               pub mod api;\npub mod nvidia;\n";
    assert_eq!(
        layout_doc_problems(lib),
        [
            "module nvidia is missing from the list (- [`nvidia`]: ...)",
            "the diagram names ghost, which is no `pub mod` of lib.rs",
            "the list names ghost, which is no `pub mod` of lib.rs",
        ]
    );
    let wrong = "//! ```text\n//! api -> nvidia\n//! ```\n//! - [`api`]: x\npub mod api;\n";
    assert_eq!(
        layout_doc_problems(wrong),
        ["the diagram says api -> nvidia, tests/architecture.rs allows api -> "]
    );
    assert_eq!(
        layout_doc_problems("//! no diagram\npub mod api;\n"),
        ["no ```text diagram in the doc comment"]
    );
}

// ---------------------------------------------------------------------------------------------
// One surface per backend

/// Files of `src/plan/` (outside `backend/`) that may read a policy's `strategy` or `backend`:
/// where a spec picks its backend (`backing.rs`, `Kind::of`; `policies.rs`, the VM workload it
/// builds into the `Backing`), and checks of policies against each other cluster-wide
/// (`assign.rs`) and of a node's GPUs or MIG geometry against a strategy (`compat.rs`,
/// `geometry.rs`).
const READS_STRATEGY: [&str; 5] = [
    "plan/assign.rs",
    "plan/backing.rs",
    "plan/compat.rs",
    "plan/geometry.rs",
    "plan/policies.rs",
];

/// Where non-test code reads a spec's strategy or backend (`spec.strategy`, `Strategy::X`,
/// `Backend::X`, `.is_vm()`), as `file:line: text`.
fn strategy_reads(rel: &str, text: &str) -> Vec<String> {
    let code = text.split("#[cfg(test)]").next().unwrap_or_default();
    code.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim_start().starts_with("//"))
        .filter(|(_, l)| {
            [
                "spec.strategy",
                "spec.backend",
                "Strategy::",
                "Backend::",
                ".is_vm()",
            ]
            .iter()
            .any(|p| {
                l.match_indices(p).any(|(i, _)| {
                    // `MigStrategy::` is MIG's own setting, not the backend.
                    !(p == &"Strategy::" && l[..i].ends_with("Mig"))
                })
            })
        })
        .map(|(i, l)| format!("src/{rel}:{}: {}", i + 1, l.trim()))
        .collect()
}

/// Each backend answers in its own file of `src/plan/backend/`, through the registry there:
/// the rest of the planner never dispatches on a policy's strategy or backend, so a new backend
/// is a new file and its arms in the registry.
#[test]
fn only_the_backend_files_dispatch_on_a_policys_strategy() {
    let reads: Vec<String> = sources()
        .iter()
        .filter(|(rel, _)| rel.starts_with("plan/") && !rel.starts_with("plan/backend/"))
        .filter(|(rel, _)| !READS_STRATEGY.contains(&rel.as_str()) && !rel.ends_with("_tests.rs"))
        .flat_map(|(rel, text)| strategy_reads(rel, text))
        .collect();
    assert!(
        reads.is_empty(),
        "dispatch on the policy's backend through plan/backend/ (its registry, mod.rs) instead:\n{}",
        reads.join("\n")
    );
}

#[test]
fn the_strategy_check_sees_a_dispatch_and_not_mig_strategy() {
    let text = "fn f() {\n  if w.spec.strategy == Strategy::Mig {}\n  // spec.strategy in a comment\n  let s = MigStrategy::Mixed;\n  let v = p.spec.strategy.is_vm();\n}\n#[cfg(test)]\nmod tests { fn t() { Strategy::Mps; } }\n";
    assert_eq!(
        strategy_reads("plan/x.rs", text),
        [
            "src/plan/x.rs:2: if w.spec.strategy == Strategy::Mig {}",
            "src/plan/x.rs:5: let v = p.spec.strategy.is_vm();",
        ]
    );
}
