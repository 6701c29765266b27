//! End-to-end: `gpu-sharing-operator plan` against a live control plane, as a CI job would run
//! it: the real binary with a read-only ServiceAccount's kubeconfig, exit codes 0 / 2 / 1, and an
//! audit log proving it never attempted a write.

mod support;

use std::path::Path;
use std::process::Output;

use support::*;

const SA_USER: &str = "system:serviceaccount:gpu-sharing-system:gpu-sharing-plan";

fn plan(kubeconfig: &Path, args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_gpu-sharing-operator"))
        .arg("plan")
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .current_dir(testkit::repo_root())
        .output()
        .unwrap()
}

fn show(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn json(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", show(o)))
}

/// The audit events of the plan ServiceAccount: (verb, resource).
fn audited(log: &Path) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["user"]["username"] == SA_USER && e["stage"] == "ResponseComplete")
        .map(|e| {
            (
                e["verb"].as_str().unwrap_or_default().to_string(),
                e["objectRef"]["resource"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
        })
        .collect()
}

#[tokio::test]
async fn plan_previews_changes_read_only_with_ci_exit_codes() {
    // Audit everything the plan ServiceAccount does.
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("audit-policy.yaml");
    std::fs::write(
        &policy,
        format!(
            "apiVersion: audit.k8s.io/v1\nkind: Policy\nrules:\n- level: Metadata\n  users: [\"{SA_USER}\"]\n- level: None\n"
        ),
    )
    .unwrap();
    let log = dir.path().join("audit.log");
    let (_g, cluster, _sim) = setup_with(
        testkit::ClusterOptions::default()
            .arg(&format!(
                "--apiserver-arg=--audit-policy-file={}",
                policy.display()
            ))
            .arg(&format!(
                "--apiserver-arg=--audit-log-path={}",
                log.display()
            )),
    )
    .await;
    let c = cluster.client.clone();
    let root = testkit::repo_root();
    for f in ["config/namespace.yaml", "config/plan-viewer.yaml"] {
        testkit::apply_path(&c, &root.join(f)).await.unwrap();
    }
    let op = Operator::start(c.clone(), None);
    for f in ["examples/mps-h200.yaml", "examples/time-slicing-l4.yaml"] {
        testkit::apply_path(&c, &root.join(f)).await.unwrap();
    }
    until("h200-mps Ready", LONG, || ready_on(&c, "h200-mps", 1)).await;
    until("l4-time-slicing Ready", LONG, || {
        ready_on(&c, "l4-time-slicing", 2)
    })
    .await;
    op.stop().await;
    // The simulated GFD relabels a moment after a config change: wait until nothing moves.
    let mut before = resource_versions(&c).await;
    loop {
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        let now = resource_versions(&c).await;
        if now == before {
            break;
        }
        before = now;
    }

    let kubeconfig =
        service_account_kubeconfig_file(&cluster, "gpu-sharing-system", "gpu-sharing-plan").await;
    // After the token request above (a write of the test's).
    let writes_before = testkit::apiserver::write_counts(&c).await.unwrap();

    // No change: the files are what the cluster runs.
    let same = plan(&kubeconfig, &["-f", "examples/mps-h200.yaml"]);
    assert_eq!(same.status.code(), Some(0), "{}", show(&same));
    assert!(
        String::from_utf8_lossy(&same.stdout).contains("No changes"),
        "{}",
        show(&same)
    );

    // What only the controller knows, plan says it assumes; the controller's flags are its
    // flags too.
    let out = String::from_utf8_lossy(&same.stdout).to_string();
    for note in [
        "note: nodes running no GPU pod now are taken as idle",
        "note: no MIG or vGPU change is taken as stuck",
        "note: no readiness taint: pass --readiness-taint",
        "note: rollouts are not paused: pass --pause-rollouts",
    ] {
        assert!(out.contains(note), "{note}:\n{out}");
    }
    let flagged = plan(
        &kubeconfig,
        &[
            "-f",
            "examples/mps-h200.yaml",
            "--readiness-taint",
            "--pause-rollouts",
        ],
    );
    assert_eq!(flagged.status.code(), Some(0), "{}", show(&flagged));
    let out = String::from_utf8_lossy(&flagged.stdout).to_string();
    assert!(
        out.contains("note: nodes running no GPU pod")
            && !out.contains("note: no readiness taint")
            && !out.contains("note: rollouts are not paused"),
        "{out}"
    );
    // The flag is read as the controller reads it: this cluster's ClusterPolicy does not
    // tolerate the taint, which a controller run with it reports on every policy.
    assert!(
        out.contains("does not tolerate gpusharing.io/unconfigured"),
        "{out}"
    );

    // An edit: MPS x4 -> x8 on the H200 node.
    let edited = dir.path().join("mps-8.yaml");
    std::fs::write(
        &edited,
        include_str!("../examples/mps-h200.yaml").replace("replicas: 4", "replicas: 8"),
    )
    .unwrap();
    let e = plan(&kubeconfig, &["-f", edited.to_str().unwrap(), "-o", "json"]);
    assert_eq!(e.status.code(), Some(2), "{}", show(&e));
    let p = json(&e);
    let nodes: Vec<&str> = p["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["name"].as_str().unwrap())
        .collect();
    assert_eq!(nodes, ["h200-node-0"], "{p:#}");
    let node = &p["nodes"][0];
    let (old, new) = (
        node["before"]["config"].as_str().unwrap(),
        node["after"]["config"].as_str().unwrap(),
    );
    assert!(
        old.starts_with("h200-mps-") && new.starts_with("h200-mps-") && old != new,
        "{node}"
    );
    assert_eq!(node["after"]["strategy"], "mps");
    assert_eq!(
        p["devicePluginConfigKeys"]["added"],
        serde_json::json!([new])
    );
    assert_eq!(
        p["devicePluginConfigKeys"]["removed"],
        serde_json::json!([old])
    );
    let h200 = p["policies"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["name"] == "h200-mps")
        .unwrap();
    assert_eq!(h200["change"], "changed");
    assert_eq!(h200["before"]["capacity"]["schedulableReplicas"], 32);
    assert_eq!(h200["after"]["capacity"]["schedulableReplicas"], 64);
    assert_eq!(h200["after"]["capacity"]["memoryPerClientMib"], 143771 / 8);
    // The L4 policies are not in the file: left as they are without --prune.
    let l4 = p["policies"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["name"] == "l4-time-slicing")
        .unwrap();
    assert_eq!(l4["change"], "unchanged");
    // The human table says the same.
    let t = plan(&kubeconfig, &["-f", edited.to_str().unwrap()]);
    assert_eq!(t.status.code(), Some(2));
    let text = String::from_utf8_lossy(&t.stdout);
    assert!(
        text.contains("h200-node-0") && text.contains(&format!("{old} -> {new}")),
        "{text}"
    );
    assert!(text.contains("32 -> 64"), "{text}");

    // --prune: the files are the complete set; the L4 policies go and their nodes are released.
    let pruned = plan(
        &kubeconfig,
        &["-f", "examples/mps-h200.yaml", "--prune", "-o", "yaml"],
    );
    assert_eq!(pruned.status.code(), Some(2), "{}", show(&pruned));
    let p: serde_json::Value =
        gpu_sharing_operator::api::yaml::from_str(&String::from_utf8_lossy(&pruned.stdout))
            .unwrap();
    let removed: Vec<&str> = p["policies"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|x| x["change"] == "removed")
        .map(|x| x["name"].as_str().unwrap())
        .collect();
    assert_eq!(removed, ["l4-heavy", "l4-time-slicing"]);
    for n in p["nodes"].as_array().unwrap() {
        assert!(n["name"].as_str().unwrap().starts_with("l4-node-"), "{n}");
        assert!(n["after"]["policy"].is_null(), "{n}");
    }

    // Invalid input: exit 1, the field named, nothing planned.
    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        include_str!("../examples/mps-h200.yaml").replace("replicas: 4", "replicas: 1"),
    )
    .unwrap();
    let b = plan(&kubeconfig, &["-f", bad.to_str().unwrap()]);
    assert_eq!(b.status.code(), Some(1), "{}", show(&b));
    assert!(
        String::from_utf8_lossy(&b.stderr).contains("spec.mps.replicas"),
        "{}",
        show(&b)
    );
    assert!(b.stdout.is_empty());

    // MIG geometry: a custom layout on the A100 node (selected by hostname, so the product is
    // not pinned): where its instances go, or, when they cannot all be placed, why.
    let geometry = |count: i32| {
        let f = dir.path().join(format!("geometry-{count}.yaml"));
        std::fs::write(
            &f,
            format!(
                "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {{name: a100-geometry}}\nspec:\n  nodeSelector: {{matchLabels: {{kubernetes.io/hostname: a100-node-0}}}}\n  strategy: mig\n  mig:\n    migStrategy: single\n    customLayout:\n    - {{migEnabled: true, migDevices: {{1g.20gb: {count}}}}}\n"
            ),
        )
        .unwrap();
        let o = plan(&kubeconfig, &["-f", f.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(2), "{}", show(&o));
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    let fits = geometry(4);
    assert!(
        fits.contains("a100-geometry: customLayout[0] on A100-SXM4-80GB: [1g.20gb@0][1g.20gb@2][1g.20gb@4][1g.20gb@6], free: 3 compute slices"),
        "{fits}"
    );
    let five = geometry(5);
    assert!(
        five.contains("Degraded:")
            && five.contains("spec.mig.customLayout[0].migDevices: A100-SXM4-80GB cannot hold")
            && five.contains("nearest feasible layout: drop one 1g.20gb"),
        "{five}"
    );

    // Read-only: nothing changed, kube-apiserver served no write (leases aside), and the
    // ServiceAccount never attempted anything but reads.
    assert_eq!(resource_versions(&c).await, before);
    let mut writes = testkit::apiserver::diff(
        &testkit::apiserver::write_counts(&c).await.unwrap(),
        &writes_before,
    );
    writes.retain(|(group, ..), _| group != "coordination.k8s.io");
    assert!(
        writes.is_empty(),
        "written while plan ran: {:?}",
        testkit::apiserver::describe(&writes)
    );
    let events = audited(&log);
    assert!(
        events.iter().any(|(v, r)| v == "list" && r == "nodes"),
        "{events:?}"
    );
    let writes: Vec<&(String, String)> = events
        .iter()
        .filter(|(v, _)| !matches!(v.as_str(), "get" | "list" | "watch"))
        .collect();
    assert!(writes.is_empty(), "writes attempted: {writes:?}");
}
