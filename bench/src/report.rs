//! The Markdown report: tables of apply and edit times, writes and ratios against the baseline,
//! per-run details, the machine.

use super::*;

pub(crate) struct Row {
    pub(crate) n: usize,
    pub(crate) p: usize,
    pub(crate) baseline: Option<BaselineResult>,
    pub(crate) op: Result<OperatorResult, String>,
    pub(crate) baseline_err: Option<String>,
}

pub(crate) fn secs(d: Option<Duration>) -> String {
    d.map(|d| format!("{:.2}", d.as_secs_f64()))
        .unwrap_or_else(|| "timeout".into())
}

pub(crate) fn render_table(rows: &[Row], steady_secs: u64) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "| N | P | baseline s | operator s | ratio | edit re-converge s | writes apply (operator / min) | writes edit (operator / min) | events (apply+edit) | finalizer patches | steady writes ({steady_secs} s) | peak RSS MiB | CPU s |\n"
    ));
    s.push_str("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for r in rows {
        let base = r
            .baseline
            .as_ref()
            .map(|b| format!("{:.2}", b.time.as_secs_f64()));
        match &r.op {
            Ok(o) => {
                let apply = o.startup.add(&o.apply);
                let ratio = match (&r.baseline, o.apply_time) {
                    (Some(b), Some(t)) => format!("{:.2}", t.as_secs_f64() / b.time.as_secs_f64()),
                    _ => "-".into(),
                };
                let steady = o.steady.core() + o.steady.events + o.steady.policy_meta;
                s.push_str(&format!(
                    "| {} | {} | {} | {} | {} | {} | {} / {} | {} / {} | {} | {} | {} | {:.1} | {:.1} |\n",
                    r.n,
                    r.p,
                    base.unwrap_or_else(|| "-".into()),
                    secs(o.apply_time),
                    ratio,
                    secs(o.edit_time),
                    apply.core(),
                    o.apply_min,
                    o.edit.core(),
                    o.edit_min,
                    apply.events + o.edit.events,
                    apply.policy_meta + o.edit.policy_meta,
                    steady,
                    o.stats.hwm_kib as f64 / 1024.0,
                    o.stats.cpu_s,
                ));
            }
            Err(e) => s.push_str(&format!(
                "| {} | {} | {} | error: {} | | | | | | | | | |\n",
                r.n,
                r.p,
                base.unwrap_or_else(|| "-".into()),
                e.replace('|', "/").lines().next().unwrap_or("")
            )),
        }
    }
    s
}

/// The cost of one policy edit next to the cluster's size, and the API server's CPU next to
/// the operator's.
pub(crate) fn render_edit_table(rows: &[Row]) -> String {
    let mut s = String::from(
        "\n| N | P | edit: nodes relabelled | first label write s | last label write s | operator passes | operator CPU s (per pass ms) | kube-local CPU s (apply / edit) | operator CPU s (apply) |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        let Ok(o) = &r.op else { continue };
        let per_pass = o.edit_passes.filter(|p| *p > 0).map_or("-".into(), |p| {
            format!("{:.0}", o.cpu_edit * 1000.0 / p as f64)
        });
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {:.2} ({per_pass}) | {:.1} / {:.1} | {:.1} |\n",
            r.n,
            r.p,
            o.edit_nodes_written,
            secs(o.edit_first_write),
            secs(o.edit_last_write),
            o.edit_passes.map_or("?".into(), |p| p.to_string()),
            o.cpu_edit,
            o.apiserver_cpu_apply,
            o.apiserver_cpu_edit,
            o.cpu_apply,
        ));
    }
    s
}

pub(crate) fn render_details(rows: &[Row]) -> String {
    let mut s = String::from("\n### Details\n");
    for r in rows {
        s.push_str(&format!("\n**{} nodes x {} policies**\n\n", r.n, r.p));
        if let Some(b) = &r.baseline {
            s.push_str(&format!(
                "- baseline: {:.2} s, {} writes\n",
                b.time.as_secs_f64(),
                b.writes
            ));
        }
        if let Some(e) = &r.baseline_err {
            s.push_str(&format!("- baseline error: {e}\n"));
        }
        let Ok(o) = &r.op else { continue };
        for (name, w) in [
            ("startup (no policies)", &o.startup),
            ("apply", &o.apply),
            ("edit", &o.edit),
            ("steady", &o.steady),
        ] {
            s.push_str(&format!(
                "- {name}: {} ; events {}, policy patches (finalizer) {}, failed (non-2xx) {}, not the operator's {}\n",
                w.breakdown(),
                w.events,
                w.policy_meta,
                w.failed,
                w.other
            ));
            if !w.detail.is_empty() {
                s.push_str(&format!("  - raw: {}\n", w.detail.join("; ")));
            }
        }
        s.push_str(&format!(
            "- operator CPU: apply {:.2} s, edit {:.2} s, total {:.2} s; kube-local (apiserver+etcd) CPU during apply {:.2} s; peak RSS {:.1} MiB, final RSS {:.1} MiB\n",
            o.cpu_apply,
            o.cpu_edit,
            o.stats.cpu_s,
            o.apiserver_cpu_apply,
            o.stats.hwm_kib as f64 / 1024.0,
            o.stats.rss_kib as f64 / 1024.0
        ));
        s.push_str(&format!(
            "- edit of one policy ({} of its nodes relabelled): first label write {} s, last {} s after the edit; {} operator passes, operator CPU {:.2} s ({}), kube-local CPU {:.2} s\n",
            o.edit_nodes_written,
            secs(o.edit_first_write),
            secs(o.edit_last_write),
            o.edit_passes.map_or("?".into(), |p| p.to_string()),
            o.cpu_edit,
            o.edit_passes
                .filter(|p| *p > 0)
                .map_or("-".into(), |p| format!("{:.0} ms per pass", o.cpu_edit * 1000.0 / p as f64)),
            o.apiserver_cpu_edit
        ));
        s.push_str(&format!(
            "- operator memory after the caches synced (nodes, no policy yet): RSS {:.1} MiB, peak {:.1} MiB\n",
            o.stats_synced.rss_kib as f64 / 1024.0,
            o.stats_synced.hwm_kib as f64 / 1024.0
        ));
        for n in &o.notes {
            s.push_str(&format!("- note: {n}\n"));
        }
    }
    s
}

pub(crate) fn machine() -> String {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map(|k| format!("{:.0} GiB", k as f64 / 1024.0 / 1024.0))
        .unwrap_or_default();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':').map(|x| x.1.trim().to_string()))
        })
        .unwrap_or_default();
    format!("{cores} cores ({cpu}), {mem} RAM")
}

pub(crate) fn write_results(args: &Args, rows: &[Row]) -> anyhow::Result<String> {
    let mut md = format!(
        "## Scale benchmark\n\nMachine: {}. kube-apiserver v1.35.4 + etcd (kube-local) on the same machine. \
         Times in seconds from creating the policies (operator) or from the first write (baseline) \
         until every node is labelled and every policy Ready. Writes exclude events and finalizer \
         patches (shown separately); minimum = 1 ConfigMap + 1 ClusterPolicy + 1 label patch per node \
         + 1 status per policy (apply), 2 ConfigMap (new key in, old key out) + 1 label patch per node \
         of the edited policy + 1 status (edit).\n\n",
        machine()
    );
    md.push_str(&render_table(rows, args.steady_secs));
    md.push_str(&render_edit_table(rows));
    md.push_str(&render_details(rows));
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(args.out.join("results.md"), &md)?;
    Ok(md)
}
