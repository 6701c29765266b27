//! End-to-end: the container image, built without a container engine (tests/image/build.sh),
//! is what the Containerfile's final stage says, small, and runs the operator from its
//! unpacked root filesystem the way a pod would: `chroot` into it as uid 65532, in-cluster
//! configuration from `KUBERNETES_SERVICE_HOST/PORT` and a ServiceAccount token and CA at
//! `/var/run/secrets/kubernetes.io/serviceaccount/` inside the root filesystem, with the
//! least-privilege RBAC of `config/`, until an example policy converges.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use support::*;

/// Largest compressed image the issue accepts.
const MAX_COMPRESSED_MIB: f64 = 25.0;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// What the Containerfile's final stage says, read here independently of the image builder:
/// USER, ENTRYPOINT, CMD and LABELs, with the stage's ARG defaults substituted.
fn final_stage() -> (
    String,
    serde_json::Value,
    serde_json::Value,
    BTreeMap<String, String>,
) {
    let text = std::fs::read_to_string(repo().join("Containerfile")).unwrap();
    let last = text
        .rfind("\nFROM scratch")
        .expect("a final stage FROM scratch");
    let (mut user, mut entrypoint, mut cmd) = (
        String::new(),
        serde_json::Value::Null,
        serde_json::Value::Null,
    );
    let (mut args, mut labels) = (BTreeMap::new(), BTreeMap::new());
    for line in text[last..].lines().map(str::trim) {
        let (instr, rest) = line.split_once(' ').unwrap_or((line, ""));
        let subst = |s: &str, args: &BTreeMap<String, String>| {
            args.iter().fold(s.to_string(), |s, (k, v)| {
                s.replace(&format!("${{{k}}}"), v)
            })
        };
        match instr {
            "ARG" => {
                let (k, v) = rest.split_once('=').unwrap_or((rest, ""));
                args.insert(k.to_string(), v.trim_matches('"').to_string());
            }
            "USER" => user = rest.to_string(),
            "ENTRYPOINT" => entrypoint = serde_json::from_str(rest).unwrap(),
            "CMD" => cmd = serde_json::from_str(rest).unwrap(),
            "LABEL" => {
                let (k, v) = rest.split_once('=').unwrap();
                labels.insert(k.to_string(), subst(v.trim_matches('"'), &args));
            }
            _ => {}
        }
    }
    (user, entrypoint, cmd, labels)
}

#[tokio::test]
async fn the_image_is_the_containerfile_and_runs_the_operator_in_cluster() {
    let image = image::Image::built();
    let (index, manifest, config) = (&image.index, &image.manifest, &image.config);
    let layers = manifest["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 1, "one layer: {manifest}");
    let compressed = layers[0]["size"].as_u64().unwrap() as f64 / (1024.0 * 1024.0);
    eprintln!(
        "image {}: one layer, {compressed:.1} MiB compressed",
        index["manifests"][0]["digest"]
    );
    assert!(compressed < MAX_COMPRESSED_MIB, "{compressed:.1} MiB");

    // The config is what the Containerfile's final stage says.
    let (user, entrypoint, cmd, labels) = final_stage();
    let c = &config["config"];
    assert_eq!(user, "65532:65532");
    assert_eq!(c["User"], user);
    assert_eq!(c["Entrypoint"], entrypoint);
    assert_eq!(c["Cmd"], cmd);
    assert_eq!(
        c["Entrypoint"],
        serde_json::json!(["/gpu-sharing-operator"])
    );
    let image_labels: BTreeMap<String, String> =
        serde_json::from_value(c["Labels"].clone()).unwrap();
    assert_eq!(image_labels, labels);
    for k in ["source", "version", "licenses"] {
        assert!(
            labels.contains_key(&format!("org.opencontainers.image.{k}")),
            "label {k}"
        );
    }
    assert_eq!(
        labels["org.opencontainers.image.version"],
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(
        labels["org.opencontainers.image.licenses"],
        env!("CARGO_PKG_LICENSE")
    );
    assert_eq!(config["os"], "linux");

    // Unpack the image's layer: that root filesystem, nothing else, runs the operator.
    let rootfs = tempfile::Builder::new()
        .prefix("image-rootfs-")
        .tempdir()
        .unwrap();
    image.unpack(rootfs.path());
    let mut files: Vec<String> = walk(rootfs.path());
    files.sort();
    assert_eq!(files, ["etc/group", "etc/passwd", "gpu-sharing-operator"]);
    let passwd = std::fs::read_to_string(rootfs.path().join("etc/passwd")).unwrap();
    assert!(passwd.contains(":65532:65532:"), "{passwd}");

    if !image::is_root() {
        panic!(
            "running the image's root filesystem needs root (chroot); the test machines run as root"
        );
    }
    run_in_cluster(rootfs.path()).await;
}

/// `args` of the operator container in `config/deployment.yaml`, `--metrics-addr` and
/// `--health-addr` replaced.
fn deployment_args(metrics: &str, health: &str) -> Vec<String> {
    let text = std::fs::read_to_string(repo().join("config/deployment.yaml")).unwrap();
    let d: serde_json::Value = gpu_sharing_operator::api::yaml::from_str(&text).unwrap();
    let args: Vec<String> =
        serde_json::from_value(d["spec"]["template"]["spec"]["containers"][0]["args"].clone())
            .unwrap();
    assert!(
        args.iter().any(|a| a.starts_with("--health-addr=")),
        "{args:?}"
    );
    args.into_iter()
        .map(|a| {
            if a.starts_with("--metrics-addr=") {
                format!("--metrics-addr={metrics}")
            } else if a.starts_with("--health-addr=") {
                format!("--health-addr={health}")
            } else {
                a
            }
        })
        .collect()
}

fn free_loopback_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The HTTP status of `GET path` on a loopback port.
fn http_status(port: u16, path: &str) -> u16 {
    let resp = http_get_raw(port, path);
    resp.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("{resp}"))
}

fn walk(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p.strip_prefix(root).unwrap().display().to_string());
            }
        }
    }
    out
}

/// Runs `/gpu-sharing-operator run` chrooted into `rootfs` as uid/gid 65532, configured the way
/// a pod is: no kubeconfig, the ServiceAccount's token, CA and namespace at the fixed path kube's
/// in-cluster config reads, and the API server's address in the environment.
async fn run_in_cluster(rootfs: &Path) {
    let (_g, cluster, _sim) = setup().await;
    let admin = cluster.client.clone();
    apply_config(&admin, &[]).await;
    let token = service_account_token(&cluster, "gpu-sharing-system", "gpu-sharing-operator").await;
    let (host, port, ca) = image::api_server(&cluster.kubeconfig);
    image::write_service_account(rootfs, &token, &ca, "gpu-sharing-system");
    image::add_default_devices(rootfs);

    // The Deployment's arguments (config/deployment.yaml), metrics and health on free loopback
    // ports.
    let (probe_port, metrics_port) = (free_loopback_port(), free_loopback_port());
    let args = deployment_args(
        &format!("127.0.0.1:{metrics_port}"),
        &format!("127.0.0.1:{probe_port}"),
    );
    assert!(args.iter().any(|a| a == "--leader-elect"), "{args:?}");
    let log = tempfile::NamedTempFile::new().unwrap();
    // env_clear drops PATH: chroot is found first.
    let mut child = tokio::process::Command::new(image::chroot())
        .arg("--userspec=65532:65532")
        .arg("--groups=65532")
        .arg(rootfs)
        .arg("/gpu-sharing-operator")
        .args(&args)
        .env_clear()
        .env("KUBERNETES_SERVICE_HOST", host)
        .env("KUBERNETES_SERVICE_PORT", port.to_string())
        .env("POD_NAME", "gpu-sharing-operator-image-test")
        .env("POD_NAMESPACE", "gpu-sharing-system")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log.reopen().unwrap())
        .kill_on_drop(true)
        .spawn()
        .expect("chroot");
    testkit::apply_yaml(&admin, include_str!("../examples/mps-h200.yaml"))
        .await
        .unwrap();
    let s = tokio::time::timeout(LONG, async {
        loop {
            if let Some(s) = ready_on(&admin, "h200-mps", 1).await {
                return s;
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "the operator exited ({status}): {}",
                    std::fs::read_to_string(log.path()).unwrap_or_default()
                );
            }
            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        }
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "h200-mps not Ready with the operator from the image: {}",
            std::fs::read_to_string(log.path()).unwrap_or_default()
        )
    });
    assert_eq!(s["capacity"]["schedulableReplicas"], 32);
    // The Deployment's readiness probe would pass.
    assert_eq!(http_status(probe_port, "/readyz"), 200);
    // The static image serves /metrics over TLS, and only with a token.
    let anonymous = support::https::get(
        ([127, 0, 0, 1], metrics_port).into(),
        "localhost",
        "/metrics",
        None,
        &support::https::Trust::Any,
    )
    .await
    .expect("a TLS answer from /metrics");
    assert_eq!(anonymous.status, 401, "{anonymous:?}");
    // It really ran as 65532, from the image's files.
    let pid = child.id().unwrap();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uid = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    assert!(
        uid.split_whitespace().skip(1).all(|u| u == "65532"),
        "{uid}"
    );
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap();
    assert!(
        exe.starts_with(std::fs::canonicalize(rootfs).unwrap()),
        "{}",
        exe.display()
    );
    child.kill().await.unwrap();
}
