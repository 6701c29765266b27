//! The GitHub Actions workflows cannot run here: they are linted with actionlint, built from
//! its Go module (github.com/rhysd/actionlint v1.7.12) into target/tools by tests/tools/build.sh,
//! their supply-chain steps are asserted by content, and every action must be pinned by commit
//! SHA.

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
        // SLSA provenance beside the signatures, for the image and the chart.
        "actions/attest-build-provenance@",
        "push-to-registry: true",
        "attestations: write",
        "id-token: write",
        // The build image by the digest resolved once per release.
        "docker buildx imagetools inspect \"${image}\"",
        "RUST_IMAGE=${{ needs.build-image.outputs.ref }}",
        // The chart pulls the image by the digest the publish job produced.
        "digest: ${{ steps.index.outputs.digest }}",
        "DIGEST: ${{ needs.publish.outputs.digest }}",
        "grep -qF \"image: ${IMAGE}@${DIGEST}\" rendered.yaml",
        // cargo-deny (advisories included) before any image is built.
        "cargo deny --locked check\n",
        "needs: [build-image, dependencies]",
    ] {
        assert!(release.contains(needle), "release.yml lacks {needle}");
    }
    assert!(
        !release.contains("azure/setup-helm"),
        "Helm is built from its Go module (checksum database), not set up by an action"
    );
    // The chart job's sed rewrites exactly the image's repository and digest lines of values.yaml.
    let values =
        std::fs::read_to_string(repo.join("charts/gpu-sharing-operator/values.yaml")).unwrap();
    let image_block: Vec<&str> = values
        .lines()
        .skip_while(|l| *l != "image:")
        .skip(1)
        .take_while(|l| l.starts_with(' ') || l.is_empty())
        .collect();
    for key in ["  repository: ", "  digest: "] {
        let all = values.lines().filter(|l| l.starts_with(key)).count();
        let in_image = image_block.iter().filter(|l| l.starts_with(key)).count();
        assert_eq!(
            (all, in_image),
            (1, 1),
            "values.yaml: the release's sed needs exactly one {key:?} line, under image:"
        );
    }
    // make test checks the dependency graph with the same deny.toml, at the version the
    // workflow installs.
    let makefile = std::fs::read_to_string(repo.join("Makefile")).unwrap();
    let tools = std::fs::read_to_string(repo.join("tests/tools/build.sh")).unwrap();
    assert!(makefile.contains("target/tools/cargo-deny check licenses bans sources"));
    assert!(tools.contains("deny=cargo-deny@0.20.2"));
    assert!(release.contains("cargo install cargo-deny --version 0.20.2 --locked"));
    assert!(repo.join("deny.toml").exists());
    // The Containerfile's build image is the ARG the workflow resolves and passes.
    let containerfile = std::fs::read_to_string(repo.join("Containerfile")).unwrap();
    for needle in [
        "\nARG RUST_IMAGE=docker.io/library/rust:",
        "\nFROM ${RUST_IMAGE} AS build\n",
        "cargo install cargo-auditable --version \"${CARGO_AUDITABLE_VERSION}\" --locked",
        "AUDITABLE=1 bash tests/image/stage-rootfs.sh",
    ] {
        assert!(
            containerfile.contains(needle),
            "Containerfile lacks {needle}"
        );
    }
}

/// Every `uses:` of a workflow that is not pinned to a full commit SHA (a local action
/// `./...` and a `docker://...@sha256:...` image are pinned by what they are), as
/// `file:line: uses: ...`. A pinned line names the release it was taken from in a comment.
fn unpinned_uses(file: &str, text: &str) -> Vec<String> {
    let mut bad = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let t = line.trim_start().trim_start_matches("- ").trim_start();
        let Some(rest) = t.strip_prefix("uses:") else {
            continue;
        };
        let (value, comment) = rest.split_once('#').unwrap_or((rest, ""));
        let value = value.trim().trim_matches(|c| c == '"' || c == '\'');
        let pinned = if value.starts_with("./") {
            true
        } else if let Some(image) = value.strip_prefix("docker://") {
            image
                .split_once("@sha256:")
                .is_some_and(|(_, d)| d.len() == 64 && d.bytes().all(|b| b.is_ascii_hexdigit()))
        } else {
            value.rsplit_once('@').is_some_and(|(action, sha)| {
                action.contains('/')
                    && sha.len() == 40
                    && sha.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
            }) && comment.trim().starts_with('v')
        };
        if !pinned {
            bad.push(format!("{file}:{}: {}", i + 1, line.trim()));
        }
    }
    bad
}

#[test]
fn workflow_actions_are_pinned_by_commit_sha() {
    // The check itself: a tag, a branch, a short SHA or a SHA without its release comment fail.
    let sha = "11d5960a326750d5838078e36cf38b85af677262";
    for bad in [
        "      - uses: actions/checkout@v4".to_string(),
        "      - uses: actions/checkout@main".to_string(),
        "        uses: actions/checkout@11d5960".to_string(),
        format!("      - uses: actions/checkout@{sha}"),
        format!(
            "      - uses: actions/checkout@{} # v4.4.0",
            sha.to_uppercase()
        ),
        "      - uses: docker://alpine:3.20".to_string(),
    ] {
        assert_eq!(unpinned_uses("t.yml", &bad).len(), 1, "{bad}");
    }
    for good in [
        format!("      - uses: actions/checkout@{sha} # v4.4.0"),
        format!("        uses: \"actions/checkout@{sha}\" # v4.4.0"),
        "      - uses: ./.github/actions/local".to_string(),
        format!("      - uses: docker://alpine@sha256:{}", "ab".repeat(32)),
    ] {
        assert!(unpinned_uses("t.yml", &good).is_empty(), "{good}");
    }

    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut uses = 0;
    let mut bad = Vec::new();
    for entry in std::fs::read_dir(repo.join(".github/workflows")).unwrap() {
        let path = entry.unwrap().path();
        if !path.extension().is_some_and(|e| e == "yml" || e == "yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        uses += text.lines().filter(|l| l.contains("uses:")).count();
        bad.extend(unpinned_uses(&name, &text));
    }
    assert!(uses > 0, "no uses: found");
    assert!(
        bad.is_empty(),
        "actions not pinned to a full commit SHA with its release as a comment \
         (`uses: owner/action@<40 hex> # vX.Y.Z`):\n{}",
        bad.join("\n")
    );
}

/// Nothing is signed before the SBOM is shown to list the crates (a static, stripped binary
/// without cargo-auditable's section would give an SBOM with none).
#[test]
fn the_release_checks_the_sboms_crates_before_signing() {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(repo.join(".github/workflows/release.yml")).unwrap();
    let at = |needle: &str| {
        text.find(needle)
            .unwrap_or_else(|| panic!("release.yml has no {needle:?}"))
    };
    let check = at("name: The SBOM lists the crates the binary holds");
    assert!(check > at("output-file: sbom.spdx.json"));
    assert!(
        check < at("cosign sign --yes"),
        "the SBOM is checked after signing"
    );
    assert!(text[check..].contains("startswith(\"pkg:cargo/\")"));
}
