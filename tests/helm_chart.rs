//! The Helm chart (`charts/gpu-sharing-operator`), with Helm v4 built from its Go module
//! (tests/tools/build.sh): lint and render for the default and a non-default set of values, bad
//! values refused naming the value, the same RBAC as `config/`, the generated CRD and values
//! table, and end to end: `helm install` on the local control plane, the operator run with the
//! chart's ServiceAccount token and arguments until an example converges, the metrics its alerts
//! and dashboard name scraped from it, `helm upgrade`, and the uninstall hook's `cleanup` run with
//! the hook's own ServiceAccount, releasing every node.

mod common;
mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use k8s_openapi::api::apps::v1::Deployment;
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
    common::parse_yaml_documents(&text).unwrap()
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
        "--metrics-addr=0.0.0.0:8080",
    ] {
        assert!(args.contains(&a.to_string()), "{a} in {args:?}");
    }
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
            "--leader-elect",
            "--lease-duration-seconds=30",
            "--lease-renew-seconds=10",
            "--readiness-taint=gpusharing.io/unconfigured",
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
            "GpuSharingNoLeader"
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
    let config = common::parse_yaml_documents(&text).unwrap();
    let (chart, config) = (grants(&chart), grants(&config));
    assert_eq!(chart.len(), 6, "{:?}", chart.keys());
    assert_eq!(chart, config, "charts/ and config/ grant differently");
    // The ServiceAccount is the one the Deployment runs as, in both.
    let sa = std::fs::read_to_string(repo().join("config/serviceaccount.yaml")).unwrap();
    assert!(sa.contains("name: gpu-sharing-operator"), "{sa}");
}

#[test]
fn chart_node_admission_policy_is_configs() {
    let text = std::fs::read_to_string(repo().join("config/node-admission-policy.yaml")).unwrap();
    let config = common::parse_yaml_documents(&text).unwrap();
    let chart = render(RELEASE, RELEASE_NS, &[]);
    let name = "gpu-sharing-operator-node-fields";
    assert_eq!(
        find(&chart, "ValidatingAdmissionPolicy", name)["spec"],
        config[0]["spec"]
    );
    assert_eq!(
        find(&chart, "ValidatingAdmissionPolicyBinding", name)["spec"],
        config[1]["spec"]
    );
    // Another release, namespace, ServiceAccount and readiness taint: the policy follows them.
    let custom = render("gso", "ops", &["--values", CUSTOM_VALUES]);
    let vap = find(
        &custom,
        "ValidatingAdmissionPolicy",
        "gso-gpu-sharing-operator-node-fields",
    );
    assert_eq!(
        vap["spec"]["matchConditions"][0]["expression"],
        "request.userInfo.username == 'system:serviceaccount:ops:gso'"
    );
    assert_eq!(
        find(
            &custom,
            "ValidatingAdmissionPolicyBinding",
            "gso-gpu-sharing-operator-node-fields"
        )["spec"]["policyName"],
        vap["metadata"]["name"]
    );
    let off = render(
        RELEASE,
        RELEASE_NS,
        &["--set", "nodeAdmissionPolicy.enabled=false"],
    );
    assert!(
        !kinds(&off)
            .iter()
            .any(|k| k.starts_with("ValidatingAdmissionPolicy"))
    );
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

/// Runs the operator binary as a pod of `deploy` would: its arguments (metrics on a loopback
/// port), its RUST_LOG, as its ServiceAccount.
async fn run_like(
    cluster: &common::TestCluster,
    deploy: &Deployment,
    metrics_port: u16,
    log: &Path,
) -> tokio::process::Child {
    let spec = deploy
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap();
    let c = &spec.containers[0];
    let sa = spec.service_account_name.as_deref().unwrap();
    let kubeconfig = service_account_kubeconfig_file(cluster, RELEASE_NS, sa).await;
    let args: Vec<String> = c
        .args
        .clone()
        .unwrap()
        .into_iter()
        .map(|a| {
            if a.starts_with("--metrics-addr=") {
                format!("--metrics-addr=127.0.0.1:{metrics_port}")
            } else {
                a
            }
        })
        .collect();
    let rust_log = c
        .env
        .as_ref()
        .unwrap()
        .iter()
        .find(|e| e.name == "RUST_LOG")
        .and_then(|e| e.value.clone())
        .unwrap();
    tokio::process::Command::new(env!("CARGO_BIN_EXE_gpu-sharing-operator"))
        .args(&args)
        .env("KUBECONFIG", kubeconfig)
        .env("RUST_LOG", rust_log)
        .env("POD_NAME", "gpu-sharing-operator-helm-test")
        .env("POD_NAMESPACE", RELEASE_NS)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

/// The hook Job's `cleanup`, run with the hook's ServiceAccount and arguments.
async fn run_cleanup(cluster: &common::TestCluster, job: &Value, timeout: Option<&str>) -> Output {
    let sa = job["spec"]["template"]["spec"]["serviceAccountName"]
        .as_str()
        .unwrap();
    let kubeconfig = service_account_kubeconfig_file(cluster, RELEASE_NS, sa).await;
    let mut args = strings(&container(job)["args"]);
    if let Some(t) = timeout {
        for a in &mut args {
            if a.starts_with("--timeout-seconds=") {
                *a = format!("--timeout-seconds={t}");
            }
        }
    }
    tokio::process::Command::new(env!("CARGO_BIN_EXE_gpu-sharing-operator"))
        .args(&args)
        .env("KUBECONFIG", kubeconfig)
        .output()
        .await
        .unwrap()
}

#[tokio::test]
async fn helm_install_runs_the_operator_and_uninstall_releases_every_node() {
    let (_g, cluster, _sim) = setup().await;
    let admin = cluster.client.clone();
    let kubeconfig = cluster.kubeconfig.display().to_string();
    let kc = [
        "--kubeconfig",
        kubeconfig.as_str(),
        "--namespace",
        RELEASE_NS,
    ];

    // Bad values fail at install and create nothing.
    let out = helm(
        &[
            &[
                "install",
                RELEASE,
                CHART,
                "--create-namespace",
                "--set",
                "replicaCount=0",
            ][..],
            &kc[..],
        ]
        .concat(),
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/replicaCount"));
    let deployments: Api<Deployment> = Api::namespaced(admin.clone(), RELEASE_NS);
    assert!(deployments.get_opt(RELEASE).await.unwrap().is_none());

    let out = helm(
        &[
            &["install", RELEASE, CHART, "--create-namespace"][..],
            &kc[..],
        ]
        .concat(),
    );
    let notes = ok(&out, "helm install");
    assert!(notes.contains("kubectl get gsp"), "NOTES.txt: {notes}");
    let deploy = deployments.get(RELEASE).await.unwrap();

    // The operator, with the chart's ServiceAccount, RBAC and arguments, converges an example.
    let log = tempfile::NamedTempFile::new().unwrap();
    let port = free_port();
    let mut operator = run_like(&cluster, &deploy, port, log.path()).await;
    common::apply_yaml(&admin, include_str!("../examples/mps-h200.yaml"))
        .await
        .unwrap();
    let s = ready_on_or_log(&admin, "h200-mps", 1, log.path()).await;
    assert_eq!(s["capacity"]["schedulableReplicas"], 32);
    let node = "h200-node-0";
    let key = labels(&admin, node).await["nvidia.com/device-plugin.config"].clone();
    assert!(key.starts_with("h200-mps-"), "{key}");

    // Every metric the alerts and the dashboard name is in its exposition, with samples.
    let metrics = http_get_raw(port, "/metrics");
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

    // helm upgrade with a changed value: the Deployment follows, the CRD and the policy stay.
    let out = helm(
        &[
            &[
                "upgrade",
                RELEASE,
                CHART,
                "--reuse-values",
                "--set",
                "logging.level=debug",
            ][..],
            &kc[..],
        ]
        .concat(),
    );
    ok(&out, "helm upgrade");
    let upgraded = deployments.get(RELEASE).await.unwrap();
    let env = upgraded.spec.unwrap().template.spec.unwrap().containers[0]
        .env
        .clone()
        .unwrap();
    assert!(
        env.iter()
            .any(|e| e.name == "RUST_LOG" && e.value.as_deref() == Some("debug"))
    );
    assert!(ready(&admin, "h200-mps").await.is_some());

    // The uninstall hook, as Helm would create it: its ServiceAccount and RBAC, then its Job's
    // command. With no operator running it times out and says what is left.
    let hooks = common::parse_yaml_documents(&ok(
        &helm(&[&["get", "hooks", RELEASE][..], &kc[..]].concat()),
        "helm get hooks",
    ))
    .unwrap();
    let job = hooks
        .iter()
        .find(|d| d["kind"] == "Job")
        .expect("a pre-delete Job")
        .clone();
    assert_eq!(job["metadata"]["annotations"]["helm.sh/hook"], "pre-delete");
    for h in hooks.iter().filter(|d| d["kind"] != "Job") {
        common::apply_yaml(&admin, &serde_json::to_string(h).unwrap())
            .await
            .unwrap();
    }
    operator.kill().await.unwrap();
    let out = run_cleanup(&cluster, &job, Some("3")).await;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "cleanup without an operator cannot finish: {err}"
    );
    assert!(
        err.contains("timed out") && err.contains("h200-mps") && err.contains(node),
        "{err}"
    );
    assert_eq!(
        labels(&admin, node).await["nvidia.com/device-plugin.config"],
        key,
        "nothing released yet"
    );

    // With the operator running, cleanup deletes the policies and waits until the nodes are free.
    let _operator = run_like(&cluster, &deploy, free_port(), log.path()).await;
    let out = run_cleanup(&cluster, &job, None).await;
    assert!(
        out.status.success(),
        "cleanup: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let policies: Api<gpu_sharing_operator::api::crd::GpuSharingPolicy> = Api::all(admin.clone());
    assert!(
        policies
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
    let l = labels(&admin, node).await;
    assert!(!l.contains_key("gpusharing.io/policy"), "{l:?}");
    assert!(
        l.get("nvidia.com/device-plugin.config") != Some(&key),
        "{l:?}"
    );
    let cm = configmap_data(&admin, "gpu-sharing-device-plugin-config")
        .await
        .unwrap_or_default();
    assert!(!cm.contains_key(&key), "{cm:?}");
    let cp = cluster_policy(&admin).await;
    assert_ne!(
        cp["spec"]["devicePlugin"]["config"]["name"], "gpu-sharing-device-plugin-config",
        "the ClusterPolicy no longer points at our ConfigMap: {}",
        cp["spec"]
    );

    // helm uninstall (the hook already ran above): the release's objects go, the CRD stays.
    ok(
        &helm(&[&["uninstall", RELEASE, "--no-hooks", "--wait"][..], &kc[..]].concat()),
        "helm uninstall",
    );
    assert!(deployments.get_opt(RELEASE).await.unwrap().is_none());
    let roles: Api<k8s_openapi::api::rbac::v1::ClusterRole> = Api::all(admin.clone());
    assert!(roles.get_opt(RELEASE).await.unwrap().is_none());
    let crds: Api<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> =
        Api::all(admin.clone());
    assert!(
        crds.get_opt("gpusharingpolicies.gpusharing.io")
            .await
            .unwrap()
            .is_some()
    );
}
