//! The GitHub Actions workflows cannot run here: they are linted with actionlint, built from
//! its Go module (github.com/rhysd/actionlint v1.7.12) into target/tools by tests/tools/build.sh.

use std::path::PathBuf;
use std::process::Command;

#[test]
fn workflows_pass_actionlint() {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("bash")
        .arg(repo.join("tests/tools/build.sh"))
        .arg("path")
        .output()
        .expect("bash");
    assert!(
        out.status.success(),
        "tests/tools/build.sh: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tools = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
    let bin = tools.join("actionlint");
    let workflows: Vec<PathBuf> = std::fs::read_dir(repo.join(".github/workflows"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yml" || e == "yaml"))
        .collect();
    assert!(!workflows.is_empty());
    let out = Command::new(&bin)
        .arg("-no-color")
        .args(&workflows)
        .current_dir(&repo)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "actionlint:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The release workflow builds both architectures natively and signs with cosign.
    let release = std::fs::read_to_string(repo.join(".github/workflows/release.yml")).unwrap();
    for needle in [
        "ubuntu-24.04-arm",
        "cosign sign",
        "cosign attest",
        "Containerfile",
        "helm package",
        "--app-version",
        "helm push",
    ] {
        assert!(release.contains(needle), "release.yml lacks {needle}");
    }
}
