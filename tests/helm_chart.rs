//! The Helm chart (`charts/gpu-sharing-operator`), with Helm v4 built from its Go module
//! (tests/tools/build.sh): lint and render for the default and a non-default set of values, bad
//! values refused naming the value, the same RBAC as `config/`, the generated CRD and values
//! table, and end to end through Helm's own code paths on the local control plane, with the test
//! pod runner (tests/support/podrunner.rs) playing the Deployment, ReplicaSet and Job
//! controllers and the kubelet, so that the chart's pod specs run from the built image:
//! `helm install --wait` (both operator pods Ready; one leads and converges an example; the
//! metrics its alerts and dashboard name scraped from it), `helm upgrade --wait` with a changed
//! pod template (the new ReplicaSet's pods replace the old, whose processes stop; the new leader
//! converges an edit), and `helm uninstall` with its pre-delete hook Job run and waited for by
//! Helm, releasing every node.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use k8s_openapi::api::apps::v1::Deployment;
use kube::ResourceExt;
use kube::api::Api;
use serde_json::Value;
use support::*;

const CHART: &str = "charts/gpu-sharing-operator";
const RELEASE: &str = "gpu-sharing-operator";
const RELEASE_NS: &str = "gpu-sharing-system";
const CUSTOM_VALUES: &str = "tests/helm/values-custom.yaml";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The Helm binary, built once (cached in target/tools).
fn helm_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let out = Command::new("bash")
            .arg(repo().join("tests/tools/build.sh"))
            .arg("path")
            .stderr(Stdio::inherit())
            .output()
            .expect("bash");
        assert!(out.status.success(), "tests/tools/build.sh failed");
        PathBuf::from(String::from_utf8(out.stdout).unwrap().trim()).join("helm")
    })
}

/// Runs helm in the repository, its cache and config under target/ (not the user's home).
fn helm(args: &[&str]) -> Output {
    let home = repo().join("target/helm-home");
    Command::new(helm_bin())
        .args(args)
        .current_dir(repo())
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"))
        .output()
        .expect("helm")
}

fn ok(out: &Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what}:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// `helm template` of the chart: every rendered object.
fn render(release: &str, namespace: &str, extra: &[&str]) -> Vec<Value> {
    let mut args = vec!["template", release, CHART, "--namespace", namespace];
    args.extend_from_slice(extra);
    let text = ok(&helm(&args), &format!("helm {args:?}"));
    testkit::parse_yaml_documents(&text).unwrap()
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} among {:?}", kinds(docs)))
}

fn kinds(docs: &[Value]) -> Vec<String> {
    let mut k: Vec<String> = docs
        .iter()
        .map(|d| {
            format!(
                "{}/{}",
                d["kind"].as_str().unwrap(),
                d["metadata"]["name"].as_str().unwrap()
            )
        })
        .collect();
    k.sort();
    k
}

fn strings(v: &Value) -> Vec<String> {
    serde_json::from_value(v.clone()).unwrap_or_default()
}

fn container(deploy_or_job: &Value) -> &Value {
    &deploy_or_job["spec"]["template"]["spec"]["containers"][0]
}

fn env_value(c: &Value, name: &str) -> Option<String> {
    c["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)
        .and_then(|e| e["value"].as_str().map(str::to_string))
}

fn chart_yaml() -> Value {
    let text = std::fs::read_to_string(repo().join(CHART).join("Chart.yaml")).unwrap();
    gpu_sharing_operator::api::yaml::from_str(&text).unwrap()
}

#[test]
fn chart_lints_and_renders_default_and_custom_values() {
    for extra in [&[][..], &["--values", CUSTOM_VALUES][..]] {
        let mut args = vec!["lint", CHART, "--strict"];
        args.extend_from_slice(extra);
        let out = ok(&helm(&args), &format!("helm {args:?}"));
        assert!(out.contains("0 chart(s) failed"), "{out}");
    }

    // Defaults: what config/ installs, plus the metrics Service and the uninstall hook.
    let docs = render(RELEASE, RELEASE_NS, &[]);
    let k: BTreeSet<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    for absent in [
        "ServiceMonitor",
        "PrometheusRule",
        "PodDisruptionBudget",
        "ConfigMap",
        "NetworkPolicy",
    ] {
        assert!(!k.contains(absent), "{absent} is opt-in: {k:?}");
    }
    let d = find(&docs, "Deployment", RELEASE);
    assert_eq!(d["metadata"]["namespace"], RELEASE_NS);
    assert_eq!(d["spec"]["replicas"], 2);
    let c = container(d);
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(
        chart_yaml()["appVersion"],
        version,
        "appVersion is the crate's"
    );
    assert_eq!(
        c["image"],
        format!("ghcr.io/gpu-sharing-operator/gpu-sharing-operator:{version}")
    );
    let args = strings(&c["args"]);
    for a in [
        "run",
        "--namespace=gpu-operator",
        "--log-format=json",
        "--leader-elect",
        "--metrics-addr=0.0.0.0:8443",
        "--health-addr=0.0.0.0:8081",
    ] {
        assert!(args.contains(&a.to_string()), "{a} in {args:?}");
    }
    // /metrics over HTTPS with authentication by default; the probes on the plain health port.
    assert!(!args.iter().any(|a| a == "--metrics-insecure"), "{args:?}");
    assert_eq!(c["readinessProbe"]["httpGet"]["port"], "health");
    assert_eq!(c["livenessProbe"]["httpGet"]["port"], "health");
    assert_eq!(env_value(c, "RUST_LOG").as_deref(), Some("info,kube=warn"));
    let spec = &d["spec"]["template"]["spec"];
    assert_eq!(spec["securityContext"]["runAsUser"], 65532);
    assert_eq!(spec["securityContext"]["runAsNonRoot"], true);
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(c["securityContext"]["capabilities"]["drop"][0], "ALL");
    // Two replicas spread over nodes unless the user sets an affinity.
    assert!(spec["affinity"]["podAntiAffinity"].is_object(), "{spec}");
    let svc = find(&docs, "Service", "gpu-sharing-operator-metrics");
    assert_eq!(svc["spec"]["ports"][0]["targetPort"], "metrics");
    let job = find(&docs, "Job", "gpu-sharing-operator-cleanup");
    assert_eq!(job["metadata"]["annotations"]["helm.sh/hook"], "pre-delete");
    assert_eq!(
        strings(&container(job)["args"]),
        ["cleanup", "--timeout-seconds=240", "--log-format=json"]
    );
    assert_eq!(container(job)["image"], c["image"]);

    // Every value of the non-default set reaches the objects.
    let docs = render("gso", "ops", &["--values", CUSTOM_VALUES]);
    let d = find(&docs, "Deployment", "gso-gpu-sharing-operator");
    assert_eq!(d["spec"]["replicas"], 3);
    let spec = &d["spec"]["template"]["spec"];
    let c = container(d);
    assert_eq!(
        c["image"],
        "registry.example.com/platform/gpu-sharing-operator@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
    );
    assert_eq!(c["imagePullPolicy"], "Always");
    assert_eq!(spec["imagePullSecrets"][0]["name"], "registry-credentials");
    assert_eq!(spec["serviceAccountName"], "gso");
    assert_eq!(spec["priorityClassName"], "system-cluster-critical");
    assert_eq!(
        spec["nodeSelector"]["node-role.kubernetes.io/control-plane"],
        ""
    );
    assert_eq!(
        spec["tolerations"][0]["key"],
        "node-role.kubernetes.io/control-plane"
    );
    assert!(spec["affinity"]["nodeAffinity"].is_object());
    assert!(spec["affinity"]["podAntiAffinity"].is_null());
    assert_eq!(
        d["spec"]["template"]["metadata"]["labels"]["team"],
        "platform"
    );
    assert_eq!(
        strings(&c["args"]),
        [
            "run",
            "--namespace=nvidia-gpu-operator",
            "--log-format=pretty",
            "--metrics-addr=0.0.0.0:9090",
            "--metrics-cert-dir=/etc/gpu-sharing-operator/metrics-certs",
            "--health-addr=0.0.0.0:8081",
            "--leader-elect",
            "--lease-duration-seconds=30",
            "--lease-renew-seconds=10",
            "--readiness-taint=gpusharing.io/unconfigured",
            "--require-fenced",
            "--mig-timeout-seconds=900",
        ]
    );
    assert_eq!(env_value(c, "RUST_LOG").as_deref(), Some("debug,kube=info"));
    assert_eq!(env_value(c, "TZ").as_deref(), Some("UTC"));
    assert_eq!(c["ports"][0]["containerPort"], 9090);
    assert_eq!(c["resources"]["limits"]["memory"], "512Mi");
    let sa = find(&docs, "ServiceAccount", "gso");
    assert_eq!(
        sa["metadata"]["annotations"]["example.com/owner"],
        "platform"
    );
    // The ConfigMap Role lives in the GPU Operator's namespace; the leader Role in the release's.
    let role = find(&docs, "Role", "gso-gpu-sharing-operator");
    assert_eq!(role["metadata"]["namespace"], "nvidia-gpu-operator");
    let binding = find(&docs, "RoleBinding", "gso-gpu-sharing-operator");
    assert_eq!(binding["subjects"][0]["name"], "gso");
    assert_eq!(binding["subjects"][0]["namespace"], "ops");
    assert_eq!(
        find(&docs, "Role", "gso-gpu-sharing-operator-leader")["metadata"]["namespace"],
        "ops"
    );
    let svc = find(&docs, "Service", "gso-gpu-sharing-operator-metrics");
    assert_eq!(svc["spec"]["ports"][0]["port"], 9091);
    let sm = find(&docs, "ServiceMonitor", "gso-gpu-sharing-operator");
    assert_eq!(sm["metadata"]["labels"]["release"], "kube-prometheus-stack");
    assert_eq!(sm["spec"]["endpoints"][0]["interval"], "15s");
    assert_eq!(
        sm["spec"]["selector"]["matchLabels"],
        svc["spec"]["selector"]
    );
    // The ServiceMonitor verifies the serving certificate with the Secret's CA.
    let tls = &sm["spec"]["endpoints"][0]["tlsConfig"];
    assert_eq!(tls["ca"]["secret"]["name"], "gso-metrics-tls");
    assert_eq!(
        tls["serverName"],
        "gso-gpu-sharing-operator-metrics.ops.svc"
    );
    assert!(tls["insecureSkipVerify"].is_null(), "{tls}");
    // The NetworkPolicy: probes from anywhere, /metrics only from the given peers.
    let np = find(&docs, "NetworkPolicy", "gso-gpu-sharing-operator");
    assert_eq!(
        np["spec"]["podSelector"]["matchLabels"],
        svc["spec"]["selector"]
    );
    assert_eq!(np["spec"]["policyTypes"], serde_json::json!(["Ingress"]));
    let ingress = np["spec"]["ingress"].as_array().unwrap();
    assert_eq!(ingress.len(), 2, "{ingress:?}");
    assert!(ingress[0]["from"].is_null());
    assert_eq!(ingress[0]["ports"][0]["port"], "health");
    assert_eq!(
        ingress[1]["from"],
        serde_json::json!([{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}}}])
    );
    assert_eq!(
        ingress[1]["ports"],
        serde_json::json!([{"port": "metrics", "protocol": "TCP"}])
    );
    let rule = find(&docs, "PrometheusRule", "gso-gpu-sharing-operator");
    let alerts: Vec<&Value> = rule["spec"]["groups"][0]["rules"]
        .as_array()
        .unwrap()
        .iter()
        .collect();
    let names: Vec<&str> = alerts
        .iter()
        .map(|a| a["alert"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "GpuSharingPolicyDegraded",
            "GpuSharingPolicyNotReady",
            "GpuSharingRolloutHalted",
            "GpuSharingReconcileErrors",
            "GpuSharingNoLeader",
            "GpuSharingNotFenced"
        ]
    );
    assert_eq!(alerts[1]["for"], "45m");
    assert!(alerts.iter().all(|a| a["labels"]["severity"] == "critical"));
    // Prometheus's own templates survive Helm's.
    assert!(
        alerts[0]["annotations"]["summary"]
            .as_str()
            .unwrap()
            .contains("{{ $labels.policy }}"),
        "{}",
        alerts[0]
    );
    let pdb = find(&docs, "PodDisruptionBudget", "gso-gpu-sharing-operator");
    assert_eq!(pdb["spec"]["minAvailable"], 2);
    let dash = find(&docs, "ConfigMap", "gso-gpu-sharing-operator-dashboard");
    assert_eq!(dash["metadata"]["namespace"], "monitoring");
    assert_eq!(dash["metadata"]["labels"]["grafana_dashboard"], "1");
    let json: Value =
        serde_json::from_str(dash["data"]["gpu-sharing-operator.json"].as_str().unwrap()).unwrap();
    assert_eq!(json["uid"], "gpu-sharing-operator");
    let job = find(&docs, "Job", "gso-gpu-sharing-operator-cleanup");
    assert_eq!(job["spec"]["activeDeadlineSeconds"], 150);
    assert_eq!(
        job["spec"]["template"]["spec"]["serviceAccountName"],
        "gso-gpu-sharing-operator-cleanup"
    );
    assert_eq!(
        job["spec"]["template"]["spec"]["nodeSelector"],
        spec["nodeSelector"]
    );

    // One replica without leader election; no hook when cleanup is off.
    let docs = render(
        RELEASE,
        RELEASE_NS,
        &[
            "--set",
            "replicaCount=1",
            "--set",
            "leaderElection.enabled=false",
            "--set",
            "cleanupOnUninstall.enabled=false",
        ],
    );
    let args = strings(&container(find(&docs, "Deployment", RELEASE))["args"]);
    assert!(
        !args
            .iter()
            .any(|a| a.starts_with("--lease") || a == "--leader-elect"),
        "{args:?}"
    );
    assert!(
        !kinds(&docs)
            .iter()
            .any(|k| k.ends_with("-leader") || k.starts_with("Job/")),
        "{:?}",
        kinds(&docs)
    );
}

/// What the release workflow's chart job does (`image.repository` and `image.digest` rewritten in
/// values.yaml to the image it pushed, signed and attested): every pod of the chart pulls
/// `repository@digest`, whatever the tag says; with no digest, the tag.
#[test]
fn chart_pulls_the_image_by_digest_when_set() {
    let digest = format!("sha256:{}", "5e".repeat(32));
    let repository = "ghcr.io/example-owner/gpu-sharing-operator";
    let docs = render(
        RELEASE,
        RELEASE_NS,
        &[
            "--set",
            &format!("image.repository={repository}"),
            "--set",
            &format!("image.digest={digest}"),
            "--set",
            "image.tag=ignored",
        ],
    );
    let want = format!("{repository}@{digest}");
    assert_eq!(container(find(&docs, "Deployment", RELEASE))["image"], want);
    let job = find(&docs, "Job", "gpu-sharing-operator-cleanup");
    assert_eq!(container(job)["image"], want);
    // The release checks the rendered manifest with grep: the line is `image: repo@digest`.
    let text = ok(
        &helm(&[
            "template",
            RELEASE,
            CHART,
            "--namespace",
            RELEASE_NS,
            "--set",
            &format!("image.repository={repository}"),
            "--set",
            &format!("image.digest={digest}"),
        ]),
        "helm template",
    );
    assert!(text.contains(&format!("image: {want}\n")), "{text}");
    // Unset, the tag (the chart's appVersion by default).
    let docs = render(RELEASE, RELEASE_NS, &["--set", "image.tag=1.2.3"]);
    assert_eq!(
        container(find(&docs, "Deployment", RELEASE))["image"],
        "ghcr.io/gpu-sharing-operator/gpu-sharing-operator:1.2.3"
    );
}

/// Issue 39: the ServiceMonitor skips certificate verification only when a value says so, and the
/// opt-in NetworkPolicy admits the default Prometheus to /metrics.
#[test]
fn service_monitor_verifies_unless_told_and_network_policy_defaults() {
    let sm_tls = |set: &[&str]| {
        let mut args = vec!["--set", "metrics.serviceMonitor.enabled=true"];
        for s in set {
            args.extend(["--set", s]);
        }
        let docs = render(RELEASE, RELEASE_NS, &args);
        find(&docs, "ServiceMonitor", RELEASE)["spec"]["endpoints"][0]["tlsConfig"].clone()
    };
    let tls = sm_tls(&["metrics.serviceMonitor.insecureSkipVerify=true"]);
    assert_eq!(tls["insecureSkipVerify"], true, "{tls}");
    assert!(tls["ca"].is_null(), "{tls}");
    // With a CA the certificate is verified, whatever the value says.
    let tls = sm_tls(&[
        "metrics.certSecret=metrics-tls",
        "metrics.serviceMonitor.insecureSkipVerify=true",
    ]);
    assert_eq!(tls["ca"]["secret"]["name"], "metrics-tls", "{tls}");
    assert_eq!(tls["ca"]["secret"]["key"], "ca.crt", "{tls}");
    assert!(tls["insecureSkipVerify"].is_null(), "{tls}");

    let docs = render(
        RELEASE,
        RELEASE_NS,
        &["--set", "networkPolicy.enabled=true"],
    );
    let np = find(&docs, "NetworkPolicy", RELEASE);
    let from = &np["spec"]["ingress"][1]["from"][0];
    assert_eq!(
        from["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
        "monitoring"
    );
    assert_eq!(
        from["podSelector"]["matchLabels"]["app.kubernetes.io/name"],
        "prometheus"
    );
    // No peers: the metrics port admits nobody, the probes still get through.
    let docs = render(
        RELEASE,
        RELEASE_NS,
        &[
            "--set",
            "networkPolicy.enabled=true",
            "--set",
            "networkPolicy.metricsFrom=null",
        ],
    );
    let ingress = &find(&docs, "NetworkPolicy", RELEASE)["spec"]["ingress"];
    assert_eq!(ingress.as_array().unwrap().len(), 1, "{ingress}");
    assert_eq!(ingress[0]["ports"][0]["port"], "health");
}

#[test]
fn bad_values_fail_naming_the_value() {
    for (set, says) in [
        ("replicaCount=0", "/replicaCount"),
        ("gpuOperator.namespace=", "/gpuOperator/namespace"),
        (
            "gpuOperator.namespace=GPU_Operator",
            "/gpuOperator/namespace",
        ),
        ("logging.format=xml", "/logging/format"),
        ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
        ("image.digest=latest", "/image/digest"),
        ("metrics.port=70000", "/metrics/port"),
        ("extraArgs[0]=foo", "/extraArgs/0"),
        ("replicaCont=2", "replicaCont"),
        ("leaderElection.enabled=false", "leaderElection.enabled"),
        (
            "leaderElection.renewSeconds=20",
            "leaderElection.renewSeconds",
        ),
        ("serviceAccount.create=false", "serviceAccount.name"),
        (
            "metrics.service.enabled=false,metrics.serviceMonitor.enabled=true",
            "metrics.service.enabled",
        ),
        // Nothing to verify the self-signed certificate with, and no skipping it by default.
        ("metrics.serviceMonitor.enabled=true", "metrics.certSecret"),
        (
            "networkPolicy.metricsFrom[0].pods=x",
            "/networkPolicy/metricsFrom/0",
        ),
    ] {
        let out = helm(&["template", RELEASE, CHART, "--set", set]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "--set {set} was accepted");
        assert!(
            err.contains(says),
            "--set {set}: the error should name {says}:\n{err}"
        );
    }
}

/// (kind, namespace, name) -> rules, or roleRef + subjects, of every RBAC object.
fn grants(docs: &[Value]) -> BTreeMap<(String, String, String), Value> {
    docs.iter()
        .filter(|d| d["apiVersion"] == "rbac.authorization.k8s.io/v1")
        .map(|d| {
            let key = (
                d["kind"].as_str().unwrap().to_string(),
                d["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or("")
                    .to_string(),
                d["metadata"]["name"].as_str().unwrap().to_string(),
            );
            let what = if d["rules"].is_null() {
                serde_json::json!({"roleRef": d["roleRef"], "subjects": d["subjects"]})
            } else {
                d["rules"].clone()
            };
            (key, what)
        })
        .collect()
}

#[test]
fn chart_rbac_grants_exactly_what_config_grants() {
    let chart = render(
        RELEASE,
        RELEASE_NS,
        &["--set", "cleanupOnUninstall.enabled=false"],
    );
    let text = std::fs::read_to_string(repo().join("config/rbac.yaml")).unwrap();
    let config = testkit::parse_yaml_documents(&text).unwrap();
    let (chart, config) = (grants(&chart), grants(&config));
    assert_eq!(chart.len(), 7, "{:?}", chart.keys());
    assert_eq!(chart, config, "charts/ and config/ grant differently");
    // The ServiceAccount is the one the Deployment runs as, in both.
    let sa = std::fs::read_to_string(repo().join("config/serviceaccount.yaml")).unwrap();
    assert!(sa.contains("name: gpu-sharing-operator"), "{sa}");
}

/// The admission policies (nodes, ClusterPolicy, owned objects): the chart's copy is config's, follows another
/// release, namespace and ServiceAccount, and each value switches off only its own policy.
#[test]
fn chart_admission_policies_are_configs() {
    let policies = [
        (
            "config/node-admission-policy.yaml",
            "node-fields",
            "nodeAdmissionPolicy",
        ),
        (
            "config/clusterpolicy-admission-policy.yaml",
            "clusterpolicy-fields",
            "clusterPolicyAdmissionPolicy",
        ),
        (
            "config/owned-objects-admission-policy.yaml",
            "owned-objects",
            "ownedObjectsAdmissionPolicy",
        ),
    ];
    let chart = render(RELEASE, RELEASE_NS, &[]);
    // Another release, namespace, ServiceAccount and readiness taint: the policies follow them.
    let custom = render("gso", "ops", &["--values", CUSTOM_VALUES]);
    let policy_names = |docs: &[Value]| -> Vec<String> {
        docs.iter()
            .filter(|d| d["kind"] == "ValidatingAdmissionPolicy")
            .map(|d| d["metadata"]["name"].as_str().unwrap().to_string())
            .collect()
    };
    for (file, suffix, value) in policies {
        let text = std::fs::read_to_string(repo().join(file)).unwrap();
        let config = testkit::parse_yaml_documents(&text).unwrap();
        let name = format!("gpu-sharing-operator-{suffix}");
        assert_eq!(
            find(&chart, "ValidatingAdmissionPolicy", &name)["spec"],
            config[0]["spec"],
            "the chart's {name} differs from {file}"
        );
        assert_eq!(
            find(&chart, "ValidatingAdmissionPolicyBinding", &name)["spec"],
            config[1]["spec"]
        );
        let name = format!("gso-gpu-sharing-operator-{suffix}");
        let vap = find(&custom, "ValidatingAdmissionPolicy", &name);
        assert_eq!(
            vap["spec"]["matchConditions"][0]["expression"],
            "request.userInfo.username.startsWith('system:serviceaccount:') && \
             request.userInfo.username.endsWith(':gso')"
        );
        assert_eq!(
            find(&custom, "ValidatingAdmissionPolicyBinding", &name)["spec"]["policyName"],
            vap["metadata"]["name"]
        );
        // No eviction in the GPU Operator's namespace, wherever that is.
        if suffix == "owned-objects" {
            let system = vap["spec"]["variables"]
                .as_array()
                .unwrap()
                .iter()
                .find(|v| v["name"] == "systemNamespaces")
                .unwrap()["expression"]
                .clone();
            assert_eq!(
                system,
                "['kube-system', 'kube-public', 'kube-node-lease', 'nvidia-gpu-operator']"
            );
        }
        let off = render(
            RELEASE,
            RELEASE_NS,
            &["--set", &format!("{value}.enabled=false")],
        );
        let mut others: Vec<String> = policies
            .iter()
            .filter(|(_, s, _)| *s != suffix)
            .map(|(_, s, _)| format!("gpu-sharing-operator-{s}"))
            .collect();
        others.sort();
        let mut names = policy_names(&off);
        names.sort();
        assert_eq!(names, others, "{value}.enabled=false");
    }
}

#[test]
fn chart_crd_is_the_generated_crd() {
    let generated =
        std::fs::read_to_string(repo().join("crds/gpusharingpolicies.gpusharing.io.yaml")).unwrap();
    let chart = std::fs::read_to_string(
        repo()
            .join(CHART)
            .join("crds/gpusharingpolicies.gpusharing.io.yaml"),
    )
    .unwrap();
    assert!(
        generated == chart,
        "charts/gpu-sharing-operator/crds/ is stale: run `make generate`"
    );
}

/// The values table of docs/install.md, from values.yaml's `# --` comments (as helm-docs writes them):
/// one row per documented key, its default as JSON.
fn values_table() -> String {
    let text = std::fs::read_to_string(repo().join(CHART).join("values.yaml")).unwrap();
    let values: Value = gpu_sharing_operator::api::yaml::from_str(&text).unwrap();
    let mut out = String::from("| Key | Default | Description |\n|---|---|---|\n");
    let mut stack: Vec<(usize, String)> = Vec::new();
    let mut doc: Option<String> = None;
    let mut documented = Vec::new();
    for line in text.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        if let Some(d) = trimmed.strip_prefix("# -- ") {
            doc = Some(d.to_string());
            continue;
        }
        if let Some(more) = trimmed.strip_prefix("# ") {
            if let Some(d) = doc.as_mut() {
                d.push(' ');
                d.push_str(more);
            }
            continue;
        }
        let Some((key, _)) = trimmed.split_once(':') else {
            continue;
        };
        if trimmed.starts_with('#') || trimmed.starts_with('-') || key.contains(' ') {
            continue;
        }
        while stack.last().is_some_and(|(i, _)| *i >= indent) {
            stack.pop();
        }
        stack.push((indent, key.to_string()));
        if let Some(d) = doc.take() {
            let path: Vec<&str> = stack.iter().map(|(_, k)| k.as_str()).collect();
            let default = path.iter().fold(&values, |v, k| &v[*k]);
            out.push_str(&format!(
                "| `{}` | `{}` | {} |\n",
                path.join("."),
                serde_json::to_string(default).unwrap(),
                d.replace('|', "\\|")
            ));
            documented.push(path.join("."));
        }
    }
    // Every value is documented, itself or through the key that holds it.
    fn leaves(v: &Value, prefix: String, out: &mut Vec<String>) {
        match v.as_object() {
            Some(m) if !m.is_empty() => {
                for (k, v) in m {
                    let p = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    leaves(v, p, out);
                }
            }
            _ => out.push(prefix),
        }
    }
    let mut all = Vec::new();
    leaves(&values, String::new(), &mut all);
    for leaf in all {
        assert!(
            documented
                .iter()
                .any(|d| leaf == *d || leaf.starts_with(&format!("{d}."))),
            "values.yaml: `{leaf}` has no `# --` description"
        );
    }
    out
}

#[test]
fn docs_values_table_is_current() {
    let table = values_table();
    let path = repo().join("docs/install.md");
    let page = std::fs::read_to_string(&path).unwrap();
    let (start, end) = ("<!-- helm-values:start -->\n", "<!-- helm-values:end -->");
    let a = page
        .find(start)
        .expect("docs/install.md has the helm-values markers")
        + start.len();
    let b = page
        .find(end)
        .expect("docs/install.md has the helm-values end marker");
    if std::env::var_os("GENERATE").is_some() {
        std::fs::write(&path, format!("{}{table}{}", &page[..a], &page[b..])).unwrap();
        return;
    }
    assert!(
        page[a..b] == table,
        "the values table of docs/install.md is stale: run `make generate`\n{table}"
    );
}

/// Metric names in an expression, as the exposition names their families (counters without
/// `_total`, histograms without `_bucket`/`_count`/`_sum`), with the sample name used.
fn metrics_in(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find("gpu_sharing_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        out.push(tail[..end].to_string());
        rest = &tail[end..];
    }
    out
}

/// Every metric the chart's alerts and dashboard name, with where.
fn metrics_the_chart_names() -> BTreeMap<String, String> {
    let docs = render(
        RELEASE,
        RELEASE_NS,
        &[
            "--set",
            "metrics.prometheusRule.enabled=true",
            "--set",
            "metrics.serviceMonitor.enabled=true",
            "--set",
            "metrics.serviceMonitor.insecureSkipVerify=true",
            "--set",
            "grafanaDashboard.enabled=true",
        ],
    );
    let mut names = BTreeMap::new();
    let rule = find(&docs, "PrometheusRule", RELEASE);
    for r in rule["spec"]["groups"][0]["rules"].as_array().unwrap() {
        for m in metrics_in(r["expr"].as_str().unwrap()) {
            names.insert(m, format!("alert {}", r["alert"]));
        }
    }
    let dash = find(&docs, "ConfigMap", "gpu-sharing-operator-dashboard");
    let json: Value =
        serde_json::from_str(dash["data"]["gpu-sharing-operator.json"].as_str().unwrap()).unwrap();
    for p in json["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            for m in metrics_in(t["expr"].as_str().unwrap()) {
                names.insert(m, format!("panel {}", p["title"]));
            }
        }
    }
    names
}

/// The release's objects, for the test pod runner.
const RELEASE_SELECTOR: &str = "app.kubernetes.io/instance=gpu-sharing-operator";

/// `helm` with the test cluster's kubeconfig and the release namespace, off the runtime's
/// threads: the pod runner keeps playing the pods while Helm waits for them.
async fn helm_on(cluster: &testkit::TestCluster, args: &[&str]) -> Output {
    let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    all.extend([
        "--kubeconfig".into(),
        cluster.kubeconfig.display().to_string(),
        "--namespace".into(),
        RELEASE_NS.into(),
    ]);
    tokio::task::spawn_blocking(move || helm(&all.iter().map(String::as_str).collect::<Vec<_>>()))
        .await
        .unwrap()
}

/// Waits up to [`LONG`] for `f`; on timeout panics with what the pod runner did and its pods'
/// logs.
async fn wait_for<T, F, Fut>(runner: &podrunner::PodRunner, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let found = tokio::time::timeout(LONG, async {
        loop {
            if let Some(v) = f().await {
                return v;
            }
            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        }
    })
    .await;
    found.unwrap_or_else(|_| panic!("timed out waiting for {what}\n{}", runner.describe()))
}

fn ok_or_describe(out: &Output, what: &str, runner: &podrunner::PodRunner) -> String {
    assert!(
        out.status.success(),
        "{what}:\n{}{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        runner.describe()
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// The operator pods the API shows (not the hook's), by name: (pod-template-hash, Ready).
async fn operator_pods(admin: &kube::Client) -> BTreeMap<String, (String, bool)> {
    use k8s_openapi::api::core::v1::Pod;
    let lp = kube::api::ListParams::default().labels(RELEASE_SELECTOR);
    Api::<Pod>::namespaced(admin.clone(), RELEASE_NS)
        .list(&lp)
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|p| {
            let hash = p
                .metadata
                .labels
                .as_ref()?
                .get("pod-template-hash")?
                .clone();
            let ready = p
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            Some((p.metadata.name?, (hash, ready)))
        })
        .collect()
}

/// The holder of the operator's Lease in the release namespace (`<pod name>-<pid>`).
async fn leader(admin: &kube::Client) -> Option<String> {
    let lease =
        Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(admin.clone(), RELEASE_NS)
            .get_opt("gpu-sharing-operator")
            .await
            .ok()??;
    lease.spec?.holder_identity.filter(|h| !h.is_empty())
}

/// What a running process is: its uids, environment and arguments (from /proc).
fn process(pid: u32) -> (String, BTreeMap<String, String>, Vec<String>) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uid = status
        .lines()
        .find(|l| l.starts_with("Uid:"))
        .unwrap()
        .to_string();
    let split = |f: &str| -> Vec<String> {
        std::fs::read(format!("/proc/{pid}/{f}"))
            .unwrap()
            .split(|b| *b == 0)
            .filter(|s| !s.is_empty())
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect()
    };
    let env = split("environ")
        .into_iter()
        .filter_map(|e| e.split_once('=').map(|(k, v)| (k.into(), v.into())))
        .collect();
    (uid, env, split("cmdline"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_runs_the_charts_pods_through_install_upgrade_and_uninstall() {
    let image = support::image::Image::built();
    let (_g, cluster, _sim) = setup().await;
    let admin = cluster.client.clone();
    // The Deployment, ReplicaSet and Job controllers and the kubelet, for the release's objects.
    let runner = podrunner::PodRunner::start(&cluster, RELEASE_NS, RELEASE_SELECTOR, image);

    // Bad values fail at install and create nothing.
    let out = helm_on(
        &cluster,
        &[
            "install",
            RELEASE,
            CHART,
            "--create-namespace",
            "--set",
            "replicaCount=0",
        ],
    )
    .await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/replicaCount"));
    let deployments: Api<Deployment> = Api::namespaced(admin.clone(), RELEASE_NS);
    assert!(deployments.get_opt(RELEASE).await.unwrap().is_none());

    // helm install --wait: Helm's own readiness check passes only once both pods of the chart's
    // Deployment run from the image and their readiness probes pass.
    let out = helm_on(
        &cluster,
        &[
            "install",
            RELEASE,
            CHART,
            "--create-namespace",
            "--wait",
            "--timeout",
            "120s",
        ],
    )
    .await;
    let notes = ok_or_describe(&out, "helm install --wait", &runner);
    assert!(notes.contains("kubectl get gsp"), "NOTES.txt: {notes}");
    let pods = operator_pods(&admin).await;
    assert_eq!(pods.len(), 2, "{pods:?}");
    assert!(pods.values().all(|(_, ready)| *ready), "{pods:?}");
    let first_hash = pods.values().next().unwrap().0.clone();
    // Each runs the chart's pod spec: its uid, its arguments, its env with the downward API's
    // values, from the image's root filesystem.
    let deploy = deployments.get(RELEASE).await.unwrap();
    let container = &deploy.spec.unwrap().template.spec.unwrap().containers[0];
    let chart_args = container.args.clone().unwrap();
    let metrics_port = container
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some("metrics"))
        .unwrap()
        .container_port as u16;
    for name in pods.keys() {
        let run = runner.pod(name).unwrap_or_else(|| panic!("{name} not run"));
        let (uid, env, argv) = process(run.pid.unwrap());
        assert!(
            uid.split_whitespace().skip(1).all(|u| u == "65532"),
            "{uid}"
        );
        assert_eq!(env["POD_NAME"], *name);
        assert_eq!(env["POD_NAMESPACE"], RELEASE_NS);
        assert_eq!(env["RUST_LOG"], "info,kube=warn");
        assert!(!env.contains_key("KUBECONFIG"), "{env:?}");
        assert_eq!(argv[0], "/gpu-sharing-operator", "the image's entrypoint");
        assert_eq!(argv[1..], chart_args[..], "the chart's arguments");
        for a in ["run", "--namespace=gpu-operator", "--leader-elect"] {
            assert!(argv.contains(&a.to_string()), "{a} in {argv:?}");
        }
    }
    let first_leader = wait_for(&runner, "a leader among the pods", || async {
        let h = leader(&admin).await?;
        pods.keys()
            .find(|p| h.starts_with(&format!("{p}-")))
            .cloned()
    })
    .await;

    // The operator, with the chart's ServiceAccount, RBAC and arguments, converges an example.
    testkit::apply_yaml(&admin, include_str!("../examples/mps-h200.yaml"))
        .await
        .unwrap();
    let s = wait_for(&runner, "h200-mps Ready on 1 node", || {
        ready_on(&admin, "h200-mps", 1)
    })
    .await;
    assert_eq!(s["capacity"]["schedulableReplicas"], 32);
    let node = "h200-node-0";
    let key = labels(&admin, node).await["nvidia.com/device-plugin.config"].clone();
    assert!(key.starts_with("h200-mps-"), "{key}");

    // Every metric the alerts and the dashboard name is in the leader's exposition, scraped as
    // Prometheus would: on the chart's metrics port inside its pod, over TLS, with the token of a
    // ServiceAccount bound to the chart's metrics-reader ClusterRole (anonymous: 401).
    testkit::apply_yaml(
        &admin,
        &format!(
            "apiVersion: v1\nkind: Namespace\nmetadata: {{name: monitoring}}\n---\n\
             apiVersion: v1\nkind: ServiceAccount\nmetadata: {{name: prometheus, namespace: monitoring}}\n---\n\
             apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata: {{name: prometheus-gso}}\n\
             roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: {RELEASE}-metrics-reader}}\n\
             subjects: [{{kind: ServiceAccount, name: prometheus, namespace: monitoring}}]\n"
        ),
    )
    .await
    .unwrap();
    let prometheus = service_account_token(&cluster, "monitoring", "prometheus").await;
    let scrape = async |token: Option<&str>| {
        let tcp = runner.connect(&first_leader, metrics_port).await.unwrap();
        https::get_over(tcp, "localhost", "/metrics", token, &https::Trust::Any)
            .await
            .unwrap()
    };
    assert_eq!(scrape(None).await.status, 401);
    let r = scrape(Some(&prometheus)).await;
    assert_eq!(r.status, 200, "{r:?}");
    let metrics = r.body;
    let named = metrics_the_chart_names();
    assert!(named.len() >= 10, "{named:?}");
    for (m, used) in &named {
        assert!(
            metrics
                .lines()
                .any(|l| l.starts_with(&format!("{m} ")) || l.starts_with(&format!("{m}{{"))),
            "{used} names {m}, which the operator does not expose:\n{metrics}"
        );
    }
    assert!(metrics.contains("gpu_sharing_policy_condition{policy=\"h200-mps\",condition=\"Ready\",reason=\"Converged\"} 1"), "{metrics}");
    assert!(
        metrics.contains("gpu_sharing_policy_schedulable_replicas{policy=\"h200-mps\"} 32"),
        "{metrics}"
    );

    // helm upgrade --wait with a value that changes the pod template: a new ReplicaSet's pods
    // replace the old ones, which are stopped.
    let out = helm_on(
        &cluster,
        &[
            "upgrade",
            RELEASE,
            CHART,
            "--reuse-values",
            "--set",
            "logging.level=debug",
            "--wait",
            "--timeout",
            "120s",
        ],
    )
    .await;
    ok_or_describe(&out, "helm upgrade --wait", &runner);
    let new_pods = wait_for(&runner, "only the new ReplicaSet's pods, Ready", || async {
        let p = operator_pods(&admin).await;
        (p.len() == 2 && p.values().all(|(h, r)| *h != first_hash && *r)).then_some(p)
    })
    .await;
    for (name, (hash, _)) in &new_pods {
        assert!(
            admin_get_rs(&admin, &format!("{RELEASE}-{hash}")).await,
            "{name}: no ReplicaSet for {hash}"
        );
        let run = runner.pod(name).unwrap();
        let (_, env, _) = process(run.pid.unwrap());
        assert_eq!(env["RUST_LOG"], "debug");
        assert_eq!(env["POD_NAME"], *name);
    }
    wait_for(
        &runner,
        "the old pods' processes stopped and their objects gone",
        || async {
            let stopped = pods.keys().all(|name| {
                let r = runner.pod(name).unwrap();
                r.stopped && r.pid.is_none()
            });
            let gone = operator_pods(&admin)
                .await
                .keys()
                .all(|n| !pods.contains_key(n));
            (stopped && gone).then_some(())
        },
    )
    .await;
    for name in pods.keys() {
        let r = runner.pod(name).unwrap();
        assert_eq!(
            r.exits,
            ["exit status: 0"],
            "{name} ended on SIGTERM: {r:?}"
        );
    }
    let new_leader = wait_for(&runner, "a new pod leading", || async {
        let h = leader(&admin).await?;
        new_pods
            .keys()
            .find(|p| h.starts_with(&format!("{p}-")))
            .cloned()
    })
    .await;

    // The new operator converges an edit: the node runs 2 MPS clients per GPU.
    use gpu_sharing_operator::api::crd::GpuSharingPolicy;
    let policies: Api<GpuSharingPolicy> = Api::all(admin.clone());
    let edited = policies
        .patch(
            "h200-mps",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"spec": {"mps": {"replicas": 2}}})),
        )
        .await
        .unwrap();
    let generation = edited.metadata.generation;
    wait_for(&runner, "h200-node-0 running the edit", || async {
        let n = Api::<k8s_openapi::api::core::v1::Node>::all(admin.clone())
            .get(node)
            .await
            .ok()?;
        let gpus = n
            .status
            .as_ref()?
            .allocatable
            .as_ref()?
            .get("nvidia.com/gpu")?
            .0
            .clone();
        let l = n.metadata.labels.clone().unwrap_or_default();
        let s = ready(&admin, "h200-mps").await?;
        (gpus == "16"
            && l.get("nvidia.com/gpu.replicas").map(String::as_str) == Some("2")
            && l.get("nvidia.com/device-plugin.config") != Some(&key)
            && s["observedGeneration"].as_i64() == generation)
            .then_some(())
    })
    .await;
    assert!(
        leader(&admin)
            .await
            .unwrap()
            .starts_with(&format!("{new_leader}-")),
        "the new pod led throughout"
    );
    // Our configs: the policy's keys in our ConfigMap (before and after the edit).
    let new_key = labels(&admin, node).await["nvidia.com/device-plugin.config"].clone();
    let mut keys: BTreeSet<String> = configmap_data(&admin, DP_CM)
        .await
        .unwrap_or_default()
        .into_keys()
        .filter(|k| k.starts_with("h200-mps-"))
        .collect();
    assert!(keys.contains(&new_key), "{new_key} in {keys:?}");
    keys.insert(key.clone());

    // helm uninstall --wait, hooks and all: Helm creates the pre-delete hook's ServiceAccount,
    // RBAC and Job, waits for the Job to complete (its `cleanup` deletes the policies and waits
    // until the still running operator has released their nodes), then removes the release.
    let out = helm_on(
        &cluster,
        &["uninstall", RELEASE, "--wait", "--timeout", "120s"],
    )
    .await;
    ok_or_describe(&out, "helm uninstall --wait", &runner);
    let hook_pods: Vec<podrunner::RunPod> = runner
        .pods()
        .into_values()
        .filter(|p| p.name.starts_with(&format!("{RELEASE}-cleanup-")))
        .collect();
    assert_eq!(hook_pods.len(), 1, "{}", runner.describe());
    assert_eq!(
        hook_pods[0].exits,
        ["exit status: 0"],
        "{}",
        runner.describe()
    );
    let left = policies.list(&Default::default()).await.unwrap().items;
    assert!(
        left.is_empty(),
        "the hook deleted every policy: {:?} left",
        left.iter().map(|p| p.name_any()).collect::<Vec<_>>()
    );
    for n in Api::<k8s_openapi::api::core::v1::Node>::all(admin.clone())
        .list(&Default::default())
        .await
        .unwrap()
    {
        let l = n.metadata.labels.clone().unwrap_or_default();
        assert!(
            !l.keys().any(|k| k.starts_with("gpusharing.io/")),
            "{}: {l:?}",
            n.name_any()
        );
        let dp = l.get("nvidia.com/device-plugin.config");
        assert!(
            dp.is_none_or(|v| !keys.contains(v)),
            "{}: {l:?}",
            n.name_any()
        );
    }
    let cm = configmap_data(&admin, DP_CM).await.unwrap_or_default();
    assert!(cm.keys().all(|k| !keys.contains(k)), "{cm:?}");
    let cp = cluster_policy(&admin).await;
    assert_ne!(
        cp["spec"]["devicePlugin"]["config"]["name"], DP_CM,
        "the ClusterPolicy no longer points at our ConfigMap: {}",
        cp["spec"]
    );
    // The release's objects go (the succeeded hook's too), the CRD stays; the garbage collector
    // removes the ReplicaSets and pods, whose containers the runner stops.
    assert!(deployments.get_opt(RELEASE).await.unwrap().is_none());
    let jobs: Api<k8s_openapi::api::batch::v1::Job> = Api::namespaced(admin.clone(), RELEASE_NS);
    assert!(
        jobs.list(&Default::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
    let roles: Api<k8s_openapi::api::rbac::v1::ClusterRole> = Api::all(admin.clone());
    assert!(roles.get_opt(RELEASE).await.unwrap().is_none());
    assert!(
        roles
            .get_opt(&format!("{RELEASE}-cleanup"))
            .await
            .unwrap()
            .is_none()
    );
    let crds: Api<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> =
        Api::all(admin.clone());
    assert!(
        crds.get_opt("gpusharingpolicies.gpusharing.io")
            .await
            .unwrap()
            .is_some()
    );
    wait_for(&runner, "every pod gone and stopped", || async {
        let left = operator_pods(&admin).await;
        let running = runner.pods().values().any(|p| p.running());
        (left.is_empty() && !running).then_some(())
    })
    .await;
}

async fn admin_get_rs(admin: &kube::Client, name: &str) -> bool {
    Api::<k8s_openapi::api::apps::v1::ReplicaSet>::namespaced(admin.clone(), RELEASE_NS)
        .get_opt(name)
        .await
        .unwrap()
        .is_some()
}
