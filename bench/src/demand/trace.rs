//! The seeded trace: single-instance MIG pods arriving as a Poisson process, each asking for one
//! profile of an A100 80GB, with a mix that shifts over the hour or stays the same.

/// A MIG profile of an A100 80GB.
pub(crate) struct Profile {
    pub name: &'static str,
    /// The extended resource the device plugin advertises it as (`mixed` strategy).
    pub resource: &'static str,
    /// Compute slices of the 7 of a GPU: what a pod of the profile costs the pool.
    pub slices: i64,
    /// Its share (per cent) of the shifting trace in each third: small pods first, then
    /// medium, then whole GPUs.
    pub mix: [f64; 3],
}

pub(crate) const PROFILES: [Profile; 5] = [
    profile("1g.10gb", "nvidia.com/mig-1g.10gb", 1, [60.0, 20.0, 10.0]),
    profile("2g.20gb", "nvidia.com/mig-2g.20gb", 2, [20.0, 20.0, 10.0]),
    profile("3g.40gb", "nvidia.com/mig-3g.40gb", 3, [10.0, 40.0, 20.0]),
    profile("4g.40gb", "nvidia.com/mig-4g.40gb", 4, [5.0, 15.0, 20.0]),
    profile("7g.80gb", "nvidia.com/mig-7g.80gb", 7, [5.0, 5.0, 40.0]),
];

const fn profile(
    name: &'static str,
    resource: &'static str,
    slices: i64,
    mix: [f64; 3],
) -> Profile {
    Profile {
        name,
        resource,
        slices,
        mix,
    }
}

/// A count per profile of [`PROFILES`], in its order.
pub(crate) type PerProfile = [i64; PROFILES.len()];

/// Compute slices of one A100 GPU: the pool's capacity is this times its GPUs.
pub(crate) const SLICES_PER_GPU: i64 = 7;

/// How the mix of profiles goes over the trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Kind {
    /// The mix changes each third (mostly 1g, then 3g/4g, then 7g): what demand-driven MIG is
    /// for.
    Shifting,
    /// One mix all along, the average of the shifting one's thirds: what a static layout fitted
    /// to the mix is for.
    Stationary,
}

impl Kind {
    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Shifting => "shifting",
            Kind::Stationary => "stationary",
        }
    }

    /// The share (per cent) of each profile among the pods arriving in `third` of the trace.
    pub fn mix(self, third: usize) -> [f64; PROFILES.len()] {
        match self {
            Kind::Shifting => PROFILES.each_ref().map(|p| p.mix[third]),
            Kind::Stationary => PROFILES.each_ref().map(|p| p.mix.iter().sum::<f64>() / 3.0),
        }
    }
}

/// One trace's settings.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Trace {
    pub seed: u64,
    pub kind: Kind,
    /// Seconds over which pods arrive.
    pub seconds: i64,
    /// Pods per second on average.
    pub rate: f64,
    /// Run time of a pod: uniform between these, in seconds.
    pub run: (i64, i64),
}

/// One pod of the trace.
#[derive(Clone, Debug)]
pub(crate) struct Arrival {
    /// `namespace/name`, sorting as the trace does.
    pub id: String,
    /// Seconds after the trace's start.
    pub at: i64,
    /// Index into [`PROFILES`].
    pub profile: usize,
    pub run: i64,
}

impl Arrival {
    /// The compute slices it holds over its run.
    pub fn slice_seconds(&self) -> i64 {
        PROFILES[self.profile].slices * self.run
    }
}

/// xorshift64*: a few lines instead of a dependency, the same trace on every machine.
#[derive(Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.max(1))
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

impl Trace {
    /// The pods, in arrival order.
    pub fn arrivals(&self) -> Vec<Arrival> {
        let mut rng = Rng::new(self.seed);
        let mut out = Vec::new();
        let mut at = 0.0f64;
        loop {
            // Exponential gaps: a Poisson arrival process.
            at += -(1.0 - rng.unit()).ln() / self.rate;
            if at >= self.seconds as f64 {
                return out;
            }
            let at = at as i64;
            let profile = pick(&self.kind.mix(self.third(at)), rng.unit() * 100.0);
            let run = self.run.0 + (rng.unit() * (self.run.1 - self.run.0) as f64) as i64;
            out.push(Arrival {
                id: format!("trace/pod-{:05}", out.len()),
                at,
                profile,
                run,
            });
        }
    }

    /// Which third of the trace second `at` falls in.
    pub fn third(&self, at: i64) -> usize {
        ((at * 3) / self.seconds).min(2) as usize
    }

    /// The offered load: slice-seconds the pods ask for over the slice-seconds a pool of
    /// `slices` compute slices has while they arrive, over the whole trace and per third.
    pub fn offered_load(&self, arrivals: &[Arrival], slices: i64) -> (f64, [f64; 3]) {
        let mut thirds = [0i64; 3];
        for a in arrivals {
            thirds[self.third(a.at)] += a.slice_seconds();
        }
        let whole = (slices * self.seconds) as f64;
        let total = thirds.iter().sum::<i64>() as f64 / whole;
        (total, thirds.map(|s| s as f64 * 3.0 / whole))
    }
}

/// The profile whose band of the cumulative mix (per cent) holds `x`.
fn pick(mix: &[f64; PROFILES.len()], mut x: f64) -> usize {
    for (i, share) in mix.iter().enumerate() {
        if x < *share {
            return i;
        }
        x -= share;
    }
    0
}
