//! The operator's container image as a container runtime would use it, without a container
//! engine (test support): built by tests/image/build.sh into an OCI image layout, its layer
//! unpacked into a root filesystem, the device nodes every container gets, the ServiceAccount
//! files a pod mounts, and the in-cluster address of the test's API server. Used by
//! tests/e2e_image.rs and by the test pod runner (tests/support/podrunner.rs).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

/// Where kube's in-cluster configuration reads the ServiceAccount's token, CA and namespace.
pub const SERVICE_ACCOUNT_DIR: &str = "var/run/secrets/kubernetes.io/serviceaccount";

/// Builds the image (cached by cargo and go); returns its output directory (the OCI layout is
/// its `gpu-sharing-operator/`).
pub fn build() -> PathBuf {
    let mut cmd = Command::new("bash");
    // Without the variables `cargo test` sets for test binaries (some make build scripts, e.g.
    // ring's, rerun): the build is then the one `make test` already did, not a second one.
    for (k, _) in std::env::vars() {
        let cargo_var = k.starts_with("CARGO") && k != "CARGO_HOME" && k != "CARGO_TERM_COLOR";
        if cargo_var || k.starts_with("RUSTC") || k.starts_with("RUSTDOC") || k == "OUT_DIR" {
            cmd.env_remove(&k);
        }
    }
    let out = cmd
        .arg(testkit::repo_root().join("tests/image/build.sh"))
        .arg("path")
        .stderr(Stdio::inherit())
        .output()
        .expect("tests/image/build.sh");
    assert!(out.status.success(), "tests/image/build.sh failed");
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// One image of an OCI image layout: its index, manifest and config.
pub struct Image {
    pub layout: PathBuf,
    pub index: Value,
    pub manifest: Value,
    pub config: Value,
}

fn json(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).unwrap()
}

impl Image {
    /// The (single) image of the layout at `layout`.
    pub fn open(layout: &Path) -> Image {
        let index = json(&std::fs::read(layout.join("index.json")).unwrap());
        let blob = |d: &Value| {
            let hex = d.as_str().unwrap().strip_prefix("sha256:").unwrap();
            std::fs::read(layout.join("blobs/sha256").join(hex)).unwrap()
        };
        let manifest = json(&blob(&index["manifests"][0]["digest"]));
        let config = json(&blob(&manifest["config"]["digest"]));
        Image {
            layout: layout.to_path_buf(),
            index,
            manifest,
            config,
        }
    }

    /// The image [`build`] makes.
    pub fn built() -> Image {
        Image::open(&build().join("gpu-sharing-operator"))
    }

    pub fn blob_path(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").expect("sha256 digest");
        self.layout.join("blobs/sha256").join(hex)
    }

    pub fn blob(&self, digest: &str) -> Vec<u8> {
        std::fs::read(self.blob_path(digest)).unwrap()
    }

    /// The manifest's digest (what a runtime reports as the image ID).
    pub fn digest(&self) -> &str {
        self.index["manifests"][0]["digest"].as_str().unwrap()
    }

    /// `name:tag` the layout names the image by (`org.opencontainers.image.ref.name`).
    pub fn ref_name(&self) -> &str {
        self.index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"]
            .as_str()
            .expect("the layout names its image")
    }

    /// Whether a pod's `image` (`registry/path/name:tag`) names this image.
    pub fn is(&self, image: &str) -> bool {
        let r = self.ref_name();
        image == r || image.ends_with(&format!("/{r}"))
    }

    /// Unpacks every layer, in order, into `rootfs`.
    pub fn unpack(&self, rootfs: &Path) {
        std::fs::create_dir_all(rootfs).unwrap();
        for layer in self.manifest["layers"].as_array().unwrap() {
            let st = Command::new("tar")
                .arg("-xzf")
                .arg(self.blob_path(layer["digest"].as_str().unwrap()))
                .arg("-C")
                .arg(rootfs)
                .status()
                .unwrap();
            assert!(st.success(), "unpacking {}", layer["digest"]);
        }
    }

    /// The config's `User` as (uid, gid), numeric as the image sets it.
    pub fn user(&self) -> (u32, u32) {
        let u = self.config["config"]["User"].as_str().unwrap_or("0");
        let (uid, gid) = u.split_once(':').unwrap_or((u, "0"));
        (uid.parse().unwrap(), gid.parse().unwrap())
    }
}

/// The device nodes every container gets from its runtime (the OCI runtime spec's default
/// devices): the operator reads randomness from /dev/urandom where the static binary cannot
/// reach the getrandom() call through glibc's dynamic lookup.
pub fn add_default_devices(rootfs: &Path) {
    let dev = rootfs.join("dev");
    std::fs::create_dir_all(&dev).unwrap();
    for (name, minor) in [
        ("null", 3),
        ("zero", 5),
        ("full", 7),
        ("random", 8),
        ("urandom", 9),
    ] {
        let st = Command::new("mknod")
            .args(["-m", "666"])
            .arg(dev.join(name))
            .args(["c", "1", &minor.to_string()])
            .status()
            .unwrap();
        assert!(st.success(), "mknod /dev/{name}");
    }
}

/// The ServiceAccount's token, CA and namespace at [`SERVICE_ACCOUNT_DIR`] inside `rootfs`,
/// readable by any uid as the kubelet's projected volume is.
pub fn write_service_account(rootfs: &Path, token: &str, ca: &[u8], namespace: &str) {
    let sa = rootfs.join(SERVICE_ACCOUNT_DIR);
    std::fs::create_dir_all(&sa).unwrap();
    std::fs::write(sa.join("token"), token).unwrap();
    std::fs::write(sa.join("ca.crt"), ca).unwrap();
    std::fs::write(sa.join("namespace"), namespace).unwrap();
    let st = Command::new("chmod")
        .args(["-R", "a+rX"])
        .arg(rootfs.join("var"))
        .status()
        .unwrap();
    assert!(st.success());
}

/// `chroot` (coreutils), found without PATH (pods run with a cleared environment).
pub fn chroot() -> &'static str {
    ["/usr/sbin/chroot", "/usr/bin/chroot", "/sbin/chroot"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("chroot (coreutils)")
}

fn base64_decode(data: &str) -> Vec<u8> {
    use std::io::Write;
    let mut child = Command::new("base64")
        .arg("-d")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(data.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    out.stdout
}

/// The API server of a kubeconfig as a pod sees it: host and port (for
/// `KUBERNETES_SERVICE_HOST/PORT`) and the cluster CA.
pub fn api_server(kubeconfig: &Path) -> (String, u16, Vec<u8>) {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig).unwrap();
    let c = kc.clusters[0].cluster.as_ref().unwrap();
    let ca = match (&c.certificate_authority_data, &c.certificate_authority) {
        (Some(data), _) => base64_decode(data),
        (None, Some(path)) => std::fs::read(path).unwrap(),
        _ => panic!("the test cluster's kubeconfig has no CA"),
    };
    // https://<host>:<port>
    let server = c.server.as_ref().unwrap();
    let (host, port) = server
        .trim_start_matches("https://")
        .trim_end_matches('/')
        .rsplit_once(':')
        .expect("host:port");
    (host.to_string(), port.parse().unwrap(), ca)
}

pub fn is_root() -> bool {
    let out = Command::new("id").arg("-u").output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim() == "0"
}
