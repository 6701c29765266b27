//! Readings of the operator's own metrics text (`/metrics`), as tests and the benchmark take
//! them.

/// The passes that ended without an error in a metrics text: `gpu_sharing_reconciles_total`
/// less every `gpu_sharing_reconcile_errors_total` series (a failed pass may have stopped
/// before its writes, so it does not show that a whole pass wrote nothing). `None` without the
/// counter.
pub fn passes_in(metrics: &str) -> Option<u64> {
    let value = |l: &str| l.rsplit_once(' ')?.1.trim().parse::<f64>().ok();
    let all = metrics
        .lines()
        .find(|l| l.starts_with("gpu_sharing_reconciles_total "))
        .and_then(value)?;
    let failed: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("gpu_sharing_reconcile_errors_total"))
        .filter_map(value)
        .sum();
    Some((all - failed).max(0.0) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_passes_are_not_counted() {
        let text = "# HELP x\ngpu_sharing_reconciles_total 7\n\
                    gpu_sharing_reconcile_errors_total{error=\"kube\"} 2\n\
                    gpu_sharing_reconcile_errors_total{error=\"timeout\"} 1\n";
        assert_eq!(passes_in(text), Some(4));
        assert_eq!(passes_in("gpu_sharing_reconciles_total 3\n"), Some(3));
        assert_eq!(passes_in("other 1\n"), None);
    }
}
