//! End-to-end: running the operator in production shape — the real binary with leader election
//! and failover, /metrics and health endpoints, and the least-privilege RBAC of config/.

mod common;
mod support;

use std::io::{Read, Write};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use support::*;

fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    let code = body.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, body))
}

#[tokio::test]
async fn leader_failover_and_metrics() {
    let (_g, cluster, _sim) = setup().await;
    let c = cluster.client.clone();
    let ports = [free_port(), free_port()];
    let lease_args = [
        "--leader-elect",
        "--lease-duration-seconds",
        "3",
        "--lease-renew-seconds",
        "1",
    ];
    let mut procs: Vec<Proc> = ["replica-a", "replica-b"]
        .iter()
        .zip(ports)
        .map(|(name, port)| {
            let addr = format!("127.0.0.1:{port}");
            let mut args: Vec<&str> = lease_args.to_vec();
            args.extend(["--metrics-addr", addr.as_str()]);
            spawn_operator(&cluster, name, &args)
        })
        .collect();
    let holder = until("a leader", LONG, || lease_holder(&c)).await;
    let leader = if holder.starts_with("replica-a") {
        0
    } else {
        1
    };
    let standby = 1 - leader;

    common::apply_yaml(&c, include_str!("../examples/mps-h200.yaml"))
        .await
        .unwrap();
    until("h200-mps Ready", LONG, || ready(&c, "h200-mps")).await;
    // Only the leader wrote.
    assert!(
        procs[leader].log().contains("applied node labels"),
        "{}",
        procs[leader].log()
    );
    assert!(
        !procs[standby].log().contains("applied"),
        "the standby wrote:\n{}",
        procs[standby].log()
    );

    // Metrics and health on the leader.
    let (code, _) = http_get(ports[leader], "/healthz").unwrap();
    assert_eq!(code, 200);
    let (code, _) = http_get(ports[leader], "/readyz").unwrap();
    assert_eq!(code, 200);
    let (code, metrics) = http_get(ports[leader], "/metrics").unwrap();
    assert_eq!(code, 200);
    for want in [
        "gpu_sharing_reconciles_total ",
        "gpu_sharing_api_writes_total{kind=\"Node\"} 1",
        "gpu_sharing_api_writes_total{kind=\"ConfigMap\"}",
        "gpu_sharing_nodes{strategy=\"mps\"} 1",
        "gpu_sharing_reconcile_duration_seconds_bucket{le=\"+Inf\"}",
        "gpu_sharing_leader 1",
    ] {
        assert!(metrics.contains(want), "missing {want:?} in\n{metrics}");
    }
    // The node cache holds every node, and their labels share strings.
    let listed = Api::<Node>::all(c.clone())
        .list_metadata(&Default::default())
        .await
        .unwrap()
        .items;
    let node_count = listed.len();
    let label_strings: usize = listed.iter().map(|n| 2 * n.labels().len()).sum();
    let gauge = |name: &str| -> u64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in\n{metrics}"))
    };
    assert_eq!(gauge("gpu_sharing_cached_nodes"), node_count as u64);
    let strings = gauge("gpu_sharing_cached_label_strings");
    assert!(
        strings > 0 && (strings as usize) < label_strings,
        "{strings} cached strings for {label_strings} label keys and values:\n{metrics}"
    );
    let (_, standby_metrics) = http_get(ports[standby], "/metrics")
        .unwrap_or_else(|| panic!("standby /metrics: log:\n{}", procs[standby].log()));
    assert!(
        standby_metrics.contains("gpu_sharing_leader 0"),
        "{standby_metrics}"
    );

    // Kill the leader hard: the standby takes over and converges a new change.
    procs[leader].0.kill().unwrap();
    procs[leader].0.wait().unwrap();
    common::apply_yaml(&c, include_str!("../examples/time-slicing-l4.yaml"))
        .await
        .unwrap();
    until("l4-time-slicing Ready after failover", LONG, || {
        ready(&c, "l4-time-slicing")
    })
    .await;
    let new_holder = lease_holder(&c).await.unwrap();
    assert!(
        new_holder.starts_with(["replica-a", "replica-b"][standby]),
        "{new_holder}"
    );
    let lease = Api::<Lease>::namespaced(c.clone(), "default")
        .get("gpu-sharing-operator")
        .await
        .unwrap();
    assert!(lease.spec.unwrap().lease_transitions.unwrap_or(0) >= 1);
    assert!(procs[standby].log().contains("became leader"));
    drop(procs);
}

fn forbidden<T: std::fmt::Debug>(r: Result<T, kube::Error>) -> bool {
    matches!(r, Err(kube::Error::Api(ref e)) if e.code == 403)
}

#[tokio::test]
async fn least_privilege_rbac_is_enough_and_no_more() {
    let (_g, cluster, _sim) = setup().await;
    let admin = cluster.client.clone();
    apply_config(&admin, &[]).await;
    let sa = service_account_client(&cluster, "gpu-sharing-system", "gpu-sharing-operator").await;
    let op = Operator::start(sa.clone(), Some(NS));
    common::apply_yaml(&admin, include_str!("../examples/mps-h200.yaml"))
        .await
        .unwrap();
    let s = until("Ready as the ServiceAccount", LONG, || {
        ready_on(&admin, "h200-mps", 1)
    })
    .await;
    assert_eq!(s["capacity"]["schedulableReplicas"], 32);

    // What it does not own, it cannot write.
    let cms: Api<ConfigMap> = Api::namespaced(sa.clone(), NS);
    let patch = json!({"data": {"x": "y"}});
    assert!(forbidden(
        cms.patch(
            "default-mig-parted-config",
            &PatchParams::default(),
            &Patch::Merge(&patch)
        )
        .await
    ));
    assert!(forbidden(
        cms.delete("default-mig-parted-config", &DeleteParams::default())
            .await
    ));
    let elsewhere: Api<ConfigMap> = Api::namespaced(sa.clone(), "default");
    let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "x"}})).unwrap();
    assert!(forbidden(
        elsewhere.create(&PostParams::default(), &cm).await
    ));
    let nodes: Api<Node> = Api::all(sa.clone());
    assert!(forbidden(
        nodes.delete("cpu-node-0", &DeleteParams::default()).await
    ));
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(sa.clone(), NS);
    assert!(forbidden(secrets.list(&Default::default()).await));
    op.stop().await;
}
