//! The controller's error type, shared by the control loop, the appliers and the finalizers,
//! with the label each failure is counted under in the metrics.

use kube::runtime::finalizer;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API error: {0}")]
    Kube(#[from] kube::Error),
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<finalizer::Error<Error>>),
    #[error("policy {0} still has nodes or config keys to clean up")]
    CleanupPending(String),
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("the GPU Operator's namespace {0} does not exist")]
    NamespaceMissing(String),
}

impl Error {
    /// The API server's answer when it refused this one write for what the object is (an
    /// admission webhook or policy, RBAC by name, an invalid or conflicting object): the pass
    /// records it and goes on. `None` for errors that concern every write (no connection,
    /// unauthenticated, throttled, the server failing): the pass fails as a whole.
    pub fn refused_write(&self) -> Option<String> {
        match self {
            Error::Kube(kube::Error::Api(s)) if matches!(s.code, 400 | 403 | 404 | 409 | 422) => {
                Some(format!("{} ({}): {}", s.code, s.reason, s.message))
            }
            _ => None,
        }
    }

    /// Every value of [`Error::metric_label`].
    pub const METRIC_LABELS: &[&str] = &[
        "kube",
        "finalizer",
        "cleanup_pending",
        "json",
        "namespace_missing",
    ];

    /// The `error` label a failed pass is counted under (`gpu_sharing_reconcile_errors_total`):
    /// one fixed value per variant, so the metric's cardinality stays bounded.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube",
            Error::Finalizer(_) => "finalizer",
            Error::CleanupPending(_) => "cleanup_pending",
            Error::Json(_) => "json",
            Error::NamespaceMissing(_) => "namespace_missing",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_has_its_own_fixed_metric_label() {
        let json = serde_json::from_str::<u8>("x").unwrap_err();
        let errors = [
            Error::Kube(kube::Error::LinesCodecMaxLineLengthExceeded),
            Error::Finalizer(Box::new(finalizer::Error::UnnamedObject)),
            Error::CleanupPending("p".into()),
            Error::Json(json),
            Error::NamespaceMissing("gpu-operator".into()),
        ];
        let labels: Vec<&str> = errors.iter().map(Error::metric_label).collect();
        assert_eq!(
            labels,
            [
                "kube",
                "finalizer",
                "cleanup_pending",
                "json",
                "namespace_missing"
            ]
        );
        assert_eq!(
            labels,
            Error::METRIC_LABELS,
            "METRIC_LABELS lists every label"
        );
    }
}
