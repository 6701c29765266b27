//! CPU time and memory of a process, from /proc (the operator's and kube-local's cost).

#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct ProcStats {
    pub(crate) hwm_kib: u64,
    pub(crate) rss_kib: u64,
    pub(crate) cpu_s: f64,
}

pub(crate) fn proc_stats(pid: u32) -> ProcStats {
    let mut s = ProcStats::default();
    if let Ok(t) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
        for l in t.lines() {
            let num = |l: &str| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|x| x.parse().ok())
                    .unwrap_or(0)
            };
            if l.starts_with("VmHWM:") {
                s.hwm_kib = num(l);
            } else if l.starts_with("VmRSS:") {
                s.rss_kib = num(l);
            }
        }
    }
    if let Ok(t) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // Fields after the command (which may contain spaces) start at field 3.
        if let Some((_, rest)) = t.rsplit_once(") ") {
            let f: Vec<&str> = rest.split_whitespace().collect();
            let utime: f64 = f.get(11).and_then(|x| x.parse().ok()).unwrap_or(0.0);
            let stime: f64 = f.get(12).and_then(|x| x.parse().ok()).unwrap_or(0.0);
            s.cpu_s = (utime + stime) / clk_tck();
        }
    }
    s
}

pub(crate) fn clk_tck() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}
