//! End-to-end: running the operator in production shape — the real binary with leader election
//! and failover, /metrics and health endpoints, /metrics behind authentication (TokenReview and
//! SubjectAccessReview, over HTTPS), and the least-privilege RBAC of config/.

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
    let health_ports = [free_port(), free_port()];
    let lease_args = [
        "--leader-elect",
        "--lease-duration-seconds",
        "3",
        "--lease-renew-seconds",
        "1",
    ];
    // Plain HTTP metrics (--metrics-insecure, as `make demo` runs it): the authenticated HTTPS
    // endpoint is `metrics_need_a_token_allowed_to_get_metrics`'s.
    let mut procs: Vec<Proc> = ["replica-a", "replica-b"]
        .iter()
        .zip(ports.into_iter().zip(health_ports))
        .map(|(name, (port, health))| {
            let addr = format!("127.0.0.1:{port}");
            let health = format!("127.0.0.1:{health}");
            let mut args: Vec<&str> = lease_args.to_vec();
            args.extend([
                "--metrics-addr",
                addr.as_str(),
                "--metrics-insecure",
                "--health-addr",
                health.as_str(),
            ]);
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

    testkit::apply_yaml(&c, include_str!("../examples/mps-h200.yaml"))
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

    // Metrics and health (on a port of its own) on the leader.
    let (code, _) = http_get(health_ports[leader], "/healthz").unwrap();
    assert_eq!(code, 200);
    let (code, _) = http_get(health_ports[leader], "/readyz").unwrap();
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
    testkit::apply_yaml(&c, include_str!("../examples/time-slicing-l4.yaml"))
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
    // NVIDIA's vGPU licensing config, beside the configs the operator reads.
    let licensing: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "licensing-config", "namespace": NS},
        "data": {"client_configuration_token.tok": "secret-token", "gridd.conf": "FeatureType=1"}
    }))
    .unwrap();
    Api::<ConfigMap>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &licensing)
        .await
        .unwrap();
    let sa = service_account_client(&cluster, "gpu-sharing-system", "gpu-sharing-operator").await;
    let op = Operator::start(sa.clone(), Some(NS));
    testkit::apply_yaml(&admin, include_str!("../examples/mps-h200.yaml"))
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
    reads_and_creates_only_its_configmaps(&sa).await;
    op.stop().await;
}

/// What the operator may do with the GPU Operator namespace's ConfigMaps: read only those it
/// needs, by name (so not NVIDIA's vGPU `licensing-config`, by any route), and create only its
/// own (by server-side apply, as it writes them; a plain create carries no name and is refused).
async fn reads_and_creates_only_its_configmaps(sa: &kube::Client) {
    use kube::api::{ListParams, WatchParams};
    let cms: Api<ConfigMap> = Api::namespaced(sa.clone(), NS);
    let by_name = |name: &str| ListParams::default().fields(&format!("metadata.name={name}"));
    assert!(forbidden(cms.get("licensing-config").await));
    assert!(forbidden(cms.list(&ListParams::default()).await));
    assert!(forbidden(cms.list(&by_name("licensing-config")).await));
    assert!(forbidden(cms.list_metadata(&ListParams::default()).await));
    let watch = cms
        .watch(
            &WatchParams::default().fields("metadata.name=licensing-config"),
            "0",
        )
        .await;
    assert!(forbidden(watch.map(|_| ())));
    // What it needs, by name: the list and watch its caches make.
    let ours = DP_CM;
    assert_eq!(cms.list(&by_name(ours)).await.unwrap().items.len(), 1);
    cms.get("default-mig-parted-config")
        .await
        .expect("NVIDIA's default MIG layouts");
    // Creating: only its own names, by apply; a plain create of any name is refused.
    let x: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "x"}})).unwrap();
    assert!(forbidden(cms.create(&PostParams::default(), &x).await));
    let apply = |name: &str| json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": NS}});
    let dry = PatchParams {
        dry_run: true,
        ..PatchParams::apply("gpu-sharing-operator")
    };
    assert!(forbidden(
        cms.patch("x", &dry, &Patch::Apply(apply("x"))).await
    ));
    let mig = "gpu-sharing-mig-parted-config";
    cms.patch(mig, &dry, &Patch::Apply(apply(mig)))
        .await
        .expect("creating its own ConfigMap by apply");
}

/// The names config/rbac.yaml lets the operator read in the GPU Operator's namespace are
/// exactly those the runtime watches (`Config::configmaps_read`), and it writes only its own.
#[test]
fn the_configmaps_rbac_grants_are_the_names_the_operator_reads() {
    let text = std::fs::read_to_string(testkit::repo_root().join("config/rbac.yaml")).unwrap();
    let docs = testkit::parse_yaml_documents(&text).unwrap();
    let role = docs
        .iter()
        .find(|d| d["kind"] == "Role" && d["metadata"]["namespace"] == NS)
        .unwrap();
    let rules: Vec<&serde_json::Value> = role["rules"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["resources"] == json!(["configmaps"]))
        .collect();
    let names = |verb: &str| -> Vec<String> {
        let mut v: Vec<String> = rules
            .iter()
            .filter(|r| r["verbs"].as_array().unwrap().contains(&json!(verb)))
            .flat_map(|r| {
                let names = r["resourceNames"].as_array();
                let names = names.unwrap_or_else(|| panic!("{verb} on every ConfigMap: {r}"));
                names.iter().map(|n| n.as_str().unwrap().to_string())
            })
            .collect();
        v.sort();
        v
    };
    let config = gpu_sharing_operator::runtime::controller::Config::default();
    let mut read: Vec<String> = config.configmaps_read().map(str::to_string).to_vec();
    read.sort();
    for verb in ["get", "list", "watch"] {
        assert_eq!(names(verb), read, "{verb}");
    }
    let mut own = vec![
        config.device_configmap.clone(),
        config.mig_configmap.clone(),
        config.vgpu_configmap.clone(),
    ];
    own.sort();
    for verb in ["create", "patch", "update", "delete"] {
        assert_eq!(names(verb), own, "{verb}");
    }
}

/// A CA, and a directory with the `tls.crt` (with the CA after it) and `tls.key` it issued for
/// `name`, as a cert-manager Secret is mounted.
fn issue_certificate(
    name: &str,
) -> (
    tokio_rustls::rustls::pki_types::CertificateDer<'static>,
    tempfile::TempDir,
) {
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    let ca = rcgen::CertifiedIssuer::self_signed(ca, rcgen::KeyPair::generate().unwrap()).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec![name.to_string()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("tls.crt"),
        format!("{}{}", cert.pem(), ca.pem()),
    )
    .unwrap();
    std::fs::write(dir.path().join("tls.key"), key.serialize_pem()).unwrap();
    (ca.der().clone(), dir)
}

/// `/metrics` as `run` serves it by default (`telemetry::server::start`, here in-process with
/// the operator's ServiceAccount and config/'s RBAC making the reviews): over HTTPS, and only for
/// a bearer token the API server authenticates (TokenReview) whose user may `get` the
/// non-resource URL /metrics (SubjectAccessReview). The health endpoints stay plain and open on
/// a port of their own.
#[tokio::test]
async fn metrics_need_a_token_allowed_to_get_metrics() {
    use gpu_sharing_operator::telemetry::{metrics::Metrics, server};
    use support::https::{self, Trust};

    let (_g, cluster, _sim) = setup().await;
    let admin = cluster.client.clone();
    apply_config(&admin, &[]).await;
    // A Prometheus-like ServiceAccount bound to config/'s metrics-reader ClusterRole (as the
    // chart ships it), and one without any permission.
    testkit::apply_yaml(
        &admin,
        r#"
apiVersion: v1
kind: Namespace
metadata: {name: monitoring}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: prometheus, namespace: monitoring}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: nosy, namespace: monitoring}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: prometheus-gpu-sharing-operator-metrics}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: gpu-sharing-operator-metrics-reader}
subjects: [{kind: ServiceAccount, name: prometheus, namespace: monitoring}]
"#,
    )
    .await
    .unwrap();
    let prometheus = service_account_token(&cluster, "monitoring", "prometheus").await;
    let nosy = service_account_token(&cluster, "monitoring", "nosy").await;
    let operator =
        service_account_client(&cluster, "gpu-sharing-system", "gpu-sharing-operator").await;
    let metrics = std::sync::Arc::new(Metrics::default());
    metrics.set_leader(true);
    metrics.count_writes("Node", 3);
    let loopback = || Some("127.0.0.1:0".to_string());
    let defaults = server::Config {
        metrics_addr: loopback(),
        health_addr: loopback(),
        ..Default::default()
    };
    let ep = server::start(&defaults, metrics.clone(), operator.clone())
        .await
        .unwrap();
    let (m, h) = (ep.metrics_addr.unwrap(), ep.health_addr.unwrap());
    let scrape = async |token: Option<&str>| {
        https::get(m, "localhost", "/metrics", token, &Trust::Any)
            .await
            .unwrap()
    };

    // Anonymous: 401, naming the scheme to use.
    let r = scrape(None).await;
    assert_eq!(r.status, 401, "{r:?}");
    assert!(
        r.headers
            .to_ascii_lowercase()
            .contains("www-authenticate: bearer"),
        "{r:?}"
    );
    // A token the API server does not know: 401.
    let r = scrape(Some("made-up")).await;
    assert_eq!(r.status, 401, "{r:?}");
    // A ServiceAccount the API server knows, but which may not get /metrics: 403.
    let r = scrape(Some(&nosy)).await;
    assert_eq!(r.status, 403, "{r:?}");
    // The Prometheus-like ServiceAccount: the OpenMetrics exposition (again from the cache).
    for _ in 0..2 {
        let r = scrape(Some(&prometheus)).await;
        assert_eq!(r.status, 200, "{r:?}");
        assert!(r.headers.contains("application/openmetrics-text"), "{r:?}");
        for want in [
            "gpu_sharing_leader 1",
            "gpu_sharing_api_writes_total{kind=\"Node\"} 3",
            "# EOF",
        ] {
            assert!(r.body.contains(want), "missing {want:?} in\n{}", r.body);
        }
    }
    // The token is still refused after an allowed scrape.
    assert_eq!(scrape(Some(&nosy)).await.status, 403);
    // Plain HTTP on the metrics port is no way around it.
    let plain = https::get_plain(m, "/metrics").await;
    assert!(plain.as_ref().is_err(), "{plain:?}");
    // Health: plain HTTP, no token, on its own port, where /metrics is not.
    for (path, code) in [("/healthz", 200), ("/readyz", 503), ("/metrics", 404)] {
        let r = https::get_plain(h, path).await.unwrap();
        assert_eq!(r.status, code, "{path}: {r:?}");
    }
    metrics.set_ready();
    assert_eq!(https::get_plain(h, "/readyz").await.unwrap().status, 200);
    drop(ep);

    // Reviews the operator may not make (RBAC without config/'s grants) refuse every scrape.
    let unprivileged = service_account_client(&cluster, "monitoring", "nosy").await;
    let ep = server::start(&defaults, metrics.clone(), unprivileged)
        .await
        .unwrap();
    let r = https::get(
        ep.metrics_addr.unwrap(),
        "localhost",
        "/metrics",
        Some(&prometheus),
        &Trust::Any,
    )
    .await
    .unwrap();
    assert_eq!(r.status, 500, "{r:?}");
    drop(ep);

    // A certificate from --metrics-cert-dir (as cert-manager issues it): verified by a scraper
    // that trusts only its CA, for the name it was issued for.
    let (ca, dir) = issue_certificate("localhost");
    let ep = server::start(
        &server::Config {
            metrics_addr: loopback(),
            metrics_cert_dir: Some(dir.path().to_path_buf()),
            ..Default::default()
        },
        metrics.clone(),
        operator.clone(),
    )
    .await
    .unwrap();
    let m = ep.metrics_addr.unwrap();
    assert_eq!(ep.health_addr, None);
    let r = https::get(
        m,
        "localhost",
        "/metrics",
        Some(&prometheus),
        &Trust::Ca(ca.clone()),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    let (other_ca, _other) = issue_certificate("localhost");
    let r = https::get(m, "localhost", "/metrics", None, &Trust::Ca(other_ca)).await;
    assert!(r.is_err(), "trusted by a CA that did not issue it: {r:?}");
    let r = https::get(m, "elsewhere.example", "/metrics", None, &Trust::Ca(ca)).await;
    assert!(
        r.is_err(),
        "trusted for a name it was not issued for: {r:?}"
    );
    drop(ep);
    // Without its files the start fails (rather than serving something else).
    let missing = server::Config {
        metrics_addr: loopback(),
        metrics_cert_dir: Some(dir.path().join("absent")),
        ..Default::default()
    };
    let err = server::start(&missing, metrics.clone(), operator.clone())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("absent"), "{err}");

    // --metrics-insecure (local use): plain HTTP, open to anyone.
    let insecure = server::Config {
        metrics_addr: loopback(),
        metrics_insecure: true,
        ..Default::default()
    };
    let ep = server::start(&insecure, metrics.clone(), operator)
        .await
        .unwrap();
    let r = https::get_plain(ep.metrics_addr.unwrap(), "/metrics")
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert!(r.body.contains("gpu_sharing_leader 1"), "{}", r.body);
}
