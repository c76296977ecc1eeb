//! `ipoib-ctl`: attach the IPoIB hybrid datapath to an interface, steer it, inspect it.

use std::{
    fs::File,
    os::fd::AsRawFd as _,
    path::{Path, PathBuf},
    process::ExitCode,
};

use anyhow::{Context as _, Result, anyhow};
use clap::{Parser, Subcommand};
use ipoib_ctl::{
    attach::{self, AttachError, IngressChoice},
    config::{self, CmArgs, cm_options, cm_pkey, cm_port, ib_link},
    connmgr, daemon,
    exit::{self, EXIT_CODES},
    netdev::Netdev,
    plan::SrqChoice,
    policy::{PolicyChange, PolicyError},
    status::{self, cm::ReceiveKind},
};

#[derive(Parser)]
#[command(
    name = "ipoib-ctl",
    version,
    about = "Control plane of the IPoIB hybrid datapath (UD for everything, CM where it pays)",
    after_help = EXIT_CODES
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Attach the fast path to IFACE and run the control loop until SIGINT/SIGTERM.
    ///
    /// Attaching an attached interface adopts its pinned programs and maps: counters go on
    /// and traffic sees no gap. On exit the programs stay; once the heartbeat is older than
    /// heartbeat-timeout the fail-safe sends every packet UD. `detach` removes them.
    #[command(after_help = "Examples:\n  ipoib-ctl attach ib0\n  \
                            ipoib-ctl attach ib0 --policy /etc/ipoib-hybrid/ib0.policy\n\n\
                            The policy file holds set-policy's KEY=VALUE settings, one per \
                            line, # comments.")]
    Attach {
        /// The IPoIB interface (or, in the lab, the Ethernet stand-in), e.g. ib0.
        iface: String,
        /// Policy file (KEY=VALUE lines, as set-policy takes them).
        #[arg(long, value_name = "FILE")]
        policy: Option<PathBuf>,
        /// As --policy, but a file that does not exist is no error: the systemd unit passes
        /// /etc/ipoib-ctl/IFACE.policy.
        #[arg(long, value_name = "FILE", conflicts_with = "policy")]
        policy_if_present: Option<PathBuf>,
        /// Write Prometheus metrics every 5 s to DIR/ipoib-ctl-IFACE.prom, replaced whole
        /// (node_exporter's textfile directory, e.g. /var/lib/prometheus/node-exporter).
        #[arg(long, value_name = "DIR")]
        metrics_textfile: Option<PathBuf>,
        /// Per-peer series in the metrics too (a series per peer and path: thousands on a
        /// large cluster).
        #[arg(long, requires = "metrics_textfile")]
        metrics_peers: bool,
        /// Where the receive program runs: `auto` is TC ingress on IPoIB (which has no native
        /// XDP; generic XDP costs more CPU per byte received) and XDP elsewhere, native where
        /// the driver has it. Taken at a fresh attach; an adopted attachment keeps its hook.
        #[arg(long, value_enum, default_value_t = IngressChoice::Auto, value_name = "HOOK")]
        ingress: IngressChoice,
        #[command(flatten)]
        cm: CmArgs,
    },
    /// Remove the programs, links and pins from IFACE; traffic keeps flowing on UD.
    #[command(after_help = "Example:\n  ipoib-ctl detach ib0")]
    Detach {
        /// The IPoIB interface (or, in the lab, the Ethernet stand-in), e.g. ib0.
        iface: String,
    },
    /// Change the policy in force on IFACE; the change is validated whole before any write.
    #[command(after_help = "Keys:\n  \
        mode=auto|datagram|connected   interface-wide mode (default auto: CM for busy peers where UD costs the CPU per datagram, none by rate where the device segments (TSO); connected: CM for every active peer within the plan)\n  \
        cm-threshold=BYTES             smallest packet worth CM, 64..65520 (default 1024)\n  \
        heartbeat-timeout=DURATION     fail-safe deadline, 100ms..1h, to the millisecond (default 3s)\n  \
        kernel-cm=on|off               let the kernel's own connected mode carry UD traffic (default off)\n  \
        ctl-port=PORT                  TCP port of the CM handshake, always UD (default 4755)\n  \
        memory-budget=SIZE             receive memory for CM, 4MiB..1TiB, within the node's budget (default: worked out)\n  \
        max-connections=N              CM connections at most, below the memory plan (takes effect live)\n  \
        peer=ADDR:ud|cm|auto|block     per-peer override (repeatable; [v6]:pin or v6:pin)\n\n\
        Examples:\n  ipoib-ctl set-policy ib0 mode=datagram\n  \
        ipoib-ctl set-policy ib0 cm-threshold=4096 peer=10.0.0.7:ud peer=[fd00::9]:block\n  \
        ipoib-ctl set-policy ib0 --file /etc/ipoib-ctl/ib0.policy")]
    SetPolicy {
        /// The IPoIB interface (or, in the lab, the Ethernet stand-in), e.g. ib0.
        iface: String,
        /// Settings to change (the keys below); the others keep their value.
        #[arg(required_unless_present = "file", value_name = "KEY=VALUE")]
        settings: Vec<String>,
        /// Take the settings from a policy file first (KEY=VALUE lines, # comments), then
        /// the words; `systemctl reload` runs it. Keys the file no longer names keep their
        /// value.
        #[arg(long, value_name = "FILE")]
        file: Option<PathBuf>,
    },
    /// Print the policy in force on IFACE, as a policy file (`set-policy --file` reads it
    /// back).
    #[command(after_help = "Examples:\n  ipoib-ctl show-policy ib0 --json\n  \
                            ipoib-ctl show-policy ib0 > /etc/ipoib-ctl/ib0.policy")]
    ShowPolicy {
        /// The IPoIB interface (or, in the lab, the Ethernet stand-in), e.g. ib0.
        iface: String,
        /// Print JSON instead of text, for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Per-interface state, decisions by reason, and peers (all attached interfaces by default).
    #[command(after_help = "Examples:\n  ipoib-ctl status\n  ipoib-ctl status ib0 --json")]
    Status {
        /// Only this interface (default: every attached one).
        iface: Option<String>,
        /// Print JSON instead of text, for scripts: an array, one object per interface.
        #[arg(long)]
        json: bool,
    },
    /// What the HCAs can do (every device and port, through verbs) and the memory plan.
    #[command(
        after_help = "Examples:\n  ipoib-ctl caps\n  ipoib-ctl caps --json\n  \
                            ipoib-ctl caps --memory-budget 1GiB\n\n\
                            Exits 5 where there is no RDMA device."
    )]
    Caps {
        /// Print JSON instead of text, for scripts.
        #[arg(long)]
        json: bool,
        /// Plan with this budget instead of the automatic one (4MiB..1TiB).
        #[arg(long, value_name = "SIZE")]
        memory_budget: Option<String>,
        /// Plan as `attach --srq` would: `off` plans rings per connection on any HCA.
        #[arg(long, value_enum, default_value_t = SrqChoice::Auto, value_name = "WHEN")]
        srq: SrqChoice,
    },
    /// Check what connected mode needs, before and after attach: the kernel, bpffs, the
    /// interface (IPoIB, the kernel's mode, offloads, partition), its HCA port (state, LID, SM,
    /// MTU, P_Key, SRQ), the memory plan, and a running attach's heartbeat.
    #[command(
        after_help = "Examples:\n  ipoib-ctl doctor\n  ipoib-ctl doctor ib0\n  \
                            ipoib-ctl doctor ib0 --json\n\n\
                            One line per check: OK, WARN or FAIL and why. Exits 0 when every \
                            line is OK, 6 when the worst is a WARN, 1 when a line FAILs."
    )]
    Doctor {
        /// The IPoIB interface to check (without one: the system and every HCA port).
        iface: Option<String>,
        /// Print JSON instead of text, for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Print a completion script for SHELL (bash, zsh, fish, elvish, powershell).
    #[command(after_help = "Examples:\n  \
        ipoib-ctl completions bash > /usr/share/bash-completion/completions/ipoib-ctl\n  \
        ipoib-ctl completions zsh > /usr/share/zsh/vendor-completions/_ipoib-ctl")]
    Completions {
        /// The shell the script is for.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the man page in roff: ipoib-ctl(8), or ipoib-ctl-SUBCOMMAND(8) (`cargo xtask
    /// install` puts them in place).
    #[command(hide = true)]
    Man { subcommand: Option<String> },
    /// Per-peer mode, pin and traffic by path on IFACE.
    #[command(after_help = "Example:\n  ipoib-ctl peers ib0 --json")]
    Peers {
        /// The IPoIB interface (or, in the lab, the Ethernet stand-in), e.g. ib0.
        iface: String,
        /// Print JSON instead of text, for scripts.
        #[arg(long)]
        json: bool,
    },
}

/// One control loop per interface: an exclusive lock on /run/ipoib-ctl/IFACE.lock.
fn lock_iface(iface: &str) -> Result<File> {
    std::fs::create_dir_all(attach::RUN_DIR)?;
    let path = lock_path(iface);
    let f = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    // SAFETY: flock on an owned, open fd.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let pid = attach::read_state(iface).and_then(|s| s.loop_pid);
        return Err(anyhow!(
            "another ipoib-ctl control loop runs for {iface}{}",
            pid.map(|p| format!(" (pid {p})")).unwrap_or_default()
        ));
    }
    Ok(f)
}

fn cmd_attach(
    iface: &str,
    policy: Option<PathBuf>,
    policy_if_present: Option<PathBuf>,
    metrics: Option<daemon::MetricsOut>,
    ingress: IngressChoice,
    cm: &CmArgs,
) -> Result<()> {
    if let Some(m) = &metrics
        && !m.dir.is_dir()
    {
        return Err(AttachError::Policy(PolicyError::Invalid {
            key: "--metrics-textfile",
            value: m.dir.display().to_string(),
            why: "not a directory".into(),
        })
        .into());
    }
    let change = match (policy, policy_if_present) {
        (Some(path), _) => PolicyChange::read_file(&path, false, &[])?,
        (None, Some(path)) => {
            let c = PolicyChange::read_file(&path, true, &[])?;
            if c.is_none() {
                tracing::info!("no policy file {}: the defaults", path.display());
            }
            c
        }
        (None, None) => None,
    };
    let dev = Netdev::lookup(iface)?;
    dev.check_attachable()?;
    let lock = lock_iface(iface)?;
    let result = control_loop(iface, &dev, change.as_ref(), metrics, ingress, cm);
    drop(lock);
    let _ = std::fs::remove_file(lock_path(iface));
    result
}

fn lock_path(iface: &str) -> PathBuf {
    attach::run_file(iface, "lock")
}

fn control_loop(
    iface: &str,
    dev: &Netdev,
    change: Option<&PolicyChange>,
    metrics: Option<daemon::MetricsOut>,
    ingress: IngressChoice,
    cm_args: &CmArgs,
) -> Result<()> {
    let link = ib_link(iface, dev, cm_args)?;
    if let Some(device) = &cm_args.cm_device {
        // Required: bad input must fail before the fast path is attached.
        connmgr::probe(
            device,
            cm_port(cm_args, link.as_ref()),
            cm_pkey(cm_args, link.as_ref()),
        )?;
    }
    let (change, kernel_mode) = config::with_kernel_mode(iface, dev, change)?;
    let mut att = attach::attach(dev, change.as_ref(), ingress)?;
    if kernel_mode.is_some() {
        att.state.kernel_mode = kernel_mode;
        attach::write_state(&att.state)?;
    }
    // Connected mode: explicit (--cm-device) must work; found by itself, it may fail to UD.
    let cm = cm_options(iface, dev, cm_args, link.as_ref(), &att)?
        .map(|options| daemon::CmSetup {
            options,
            required: cm_args.cm_device.is_some(),
        })
        .ok_or_else(|| {
            if cm_args.no_cm {
                "--no-cm".to_owned()
            } else {
                format!("no RDMA device under {iface}")
            }
        });
    daemon::run(iface, att, cm, metrics)?;
    Ok(())
}

fn print_json<T: serde::Serialize>(v: &T) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

fn attached_ifaces() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(attach::PIN_ROOT)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Attach {
            iface,
            policy,
            policy_if_present,
            metrics_textfile,
            metrics_peers,
            ingress,
            cm,
        } => {
            let metrics = metrics_textfile.map(|dir| daemon::MetricsOut {
                dir,
                per_peer: metrics_peers,
            });
            cmd_attach(&iface, policy, policy_if_present, metrics, ingress, &cm)
        }
        Cmd::Detach { iface } => {
            attach::detach(&iface)?;
            println!("detached {iface}; traffic continues on the kernel's own path");
            Ok(())
        }
        Cmd::SetPolicy {
            iface,
            settings,
            file,
        } => cmd_set_policy(&iface, &settings, file.as_deref()),
        Cmd::ShowPolicy { iface, json } => cmd_show_policy(&iface, json),
        Cmd::Status { iface, json } => cmd_status(iface, json),
        Cmd::Caps {
            json,
            memory_budget,
            srq,
        } => caps(json, memory_budget.as_deref(), srq),
        // Printed before the root check, in main; the doctor exits with its own code.
        Cmd::Completions { .. } | Cmd::Man { .. } | Cmd::Doctor { .. } => Ok(()),
        Cmd::Peers { iface, json } => {
            let peers = status::peers(&attach::open(&iface)?)?;
            if json {
                print_json(&peers)
            } else {
                print!("{iface}:\n{}", status::render_peers(&peers));
                Ok(())
            }
        }
    }
}

fn cmd_set_policy(iface: &str, settings: &[String], file: Option<&Path>) -> Result<()> {
    let change = match file {
        Some(path) => PolicyChange::read_file(path, false, settings)?.unwrap_or_default(),
        None => PolicyChange::parse(settings)?,
    };
    if let Some(b) = change.memory_budget {
        check_against_node(b)?;
    }
    // kernel-cm=off on an interface in the kernel's connected mode with a big MTU: refused,
    // as at attach.
    if change.kernel_cm == Some(false)
        && let Ok(Some(mode)) = ipoib_ctl::iblink::kernel_mode(Path::new("/sys"), iface)
    {
        ipoib_ctl::iblink::kernel_cm_for(iface, mode, Some(false))
            .map_err(config::ConfigError::from)?;
    }
    let mut maps = attach::open(iface)?;
    let mut state = attach::read_state(iface).ok_or_else(|| AttachError::NotAttached {
        iface: iface.to_string(),
        dir: attach::pin_dir(iface),
    })?;
    let p = attach::set_policy(&mut maps, &mut state, &change)?;
    println!(
        "{iface}: {}",
        status::PolicyView::new(&p, Some(&state)).render()
    );
    if let (Some(b), Some(cm)) = (
        change.memory_budget,
        ipoib_ctl::status::cm::read_status(iface),
    ) {
        println!("{}", budget_note(b, &cm.receive));
    }
    Ok(())
}

/// When a new `memory-budget` reaches the running loop's receive side.
fn budget_note(budget: u64, r: &ipoib_ctl::status::cm::ReceiveStatus) -> String {
    use ipoib_ctl::policy::format_size;
    let ring = u64::from(r.depth) * ipoib_ctl::plan::CM_BUF_STRIDE;
    let planned = r.max_rings as usize;
    let rings = connmgr::live_cap(planned, None, Some(budget), Some(ring));
    match r.model {
        ReceiveKind::Rings if rings < planned => format!(
            "memory-budget: {rings} ring(s) of {} now (connections past them are closed \
             within a tick)",
            format_size(ring)
        ),
        ReceiveKind::Rings => format!(
            "memory-budget: at most the {} ring(s) this attach planned until the next attach",
            r.max_rings
        ),
        ReceiveKind::Srq => format!(
            "memory-budget: the SRQ ({} registered) is made once; {} takes effect at the next \
             attach",
            format_size(r.registered_bytes),
            format_size(budget)
        ),
    }
}

/// An interface's `memory-budget` must fit the node's budget: the smallest a running attach
/// was given, else the automatic one.
fn check_against_node(b: u64) -> Result<(), PolicyError> {
    use ipoib_ctl::policy::format_size;
    let auto = ipoib_ctl::plan::budget(ipoib_ctl::verbs::system_memory(), None).0;
    let shares = ipoib_ctl::ledger::shares_now().unwrap_or_default();
    let node = shares.iter().map(|s| s.node_budget).fold(auto, u64::min);
    if b > node {
        return Err(PolicyError::Invalid {
            key: "memory-budget",
            value: format_size(b),
            why: format!(
                "more than the node's budget of {}, which its interfaces share \
                 (`attach --node-memory-budget` sets it)",
                format_size(node)
            ),
        });
    }
    Ok(())
}

fn cmd_show_policy(iface: &str, json: bool) -> Result<()> {
    let maps = attach::open(iface)?;
    let view = status::PolicyView::new(&maps.policy()?, attach::read_state(iface).as_ref());
    if json {
        return print_json(&view);
    }
    let pins: Vec<(String, ipoib_common::PeerPin)> = status::peers(&maps)?
        .into_iter()
        .map(|p| (p.addr, p.pin))
        .collect();
    print!("{}", view.render_file(iface, &pins));
    Ok(())
}

fn cmd_status(iface: Option<String>, json: bool) -> Result<()> {
    let ifaces = match iface {
        Some(i) => vec![i],
        None => attached_ifaces(),
    };
    let all: Vec<_> = ifaces
        .iter()
        .map(|i| status::gather(i))
        .collect::<Result<_, _>>()?;
    if json {
        return print_json(&all);
    }
    if all.is_empty() {
        println!("no interface is attached (ipoib-ctl attach IFACE)");
    }
    for s in &all {
        print!("{}", status::render(s));
    }
    Ok(())
}

/// The node's budget and what each running attach holds of it.
fn print_node_budget(node: u64, source: &str, shares: &[ipoib_ctl::ledger::Share]) {
    use ipoib_ctl::policy::format_size;
    let held: Vec<String> = shares
        .iter()
        .map(|s| format!("{} {}", s.iface, format_size(s.bytes)))
        .collect();
    println!(
        "node budget: {} ({source}), shared by the node's attached interfaces; held now: {}",
        format_size(node),
        if held.is_empty() {
            "nothing".to_string()
        } else {
            held.join(", ")
        }
    );
}

fn caps(json: bool, memory_budget: Option<&str>, srq: SrqChoice) -> Result<()> {
    use ipoib_ctl::{plan, verbs};
    let budget = match memory_budget {
        Some(v) => Some(
            PolicyChange::parse(&[format!("memory-budget={v}")])?
                .memory_budget
                .expect("parsed"),
        ),
        None => None,
    };
    let devices = verbs::discover()?;
    let mem = verbs::system_memory();
    // The node's budget, shared by its attached interfaces. The plan is what one more attach
    // would make.
    let ipoib_ctl::ledger::NodeNow {
        budget: node,
        source: node_source,
        free,
        shares,
    } = ipoib_ctl::ledger::node_budget_now(mem);
    let planned: Vec<_> = devices
        .iter()
        .map(|d| {
            let p = match budget {
                Some(b) => plan::plan_with(&d.limits(), mem, Some(b), srq),
                None => plan::plan_for_node(&d.limits(), mem, node, free, None, srq),
            };
            (d, p)
        })
        .collect();
    if json {
        let v: Vec<_> = planned
            .iter()
            .map(|(d, p)| serde_json::json!({ "device": d, "plan": p }))
            .collect();
        return print_json(&serde_json::json!({
            "system_memory": mem,
            "devices": v,
            "node_budget": { "budget_bytes": node, "source": node_source, "shares": shares },
        }));
    }
    for (d, p) in &planned {
        print_device(d);
        print_plan(p);
    }
    print_node_budget(node, &node_source, &shares);
    Ok(())
}

fn print_device(d: &ipoib_ctl::verbs::DeviceCaps) {
    println!(
        "{}: fw {} node_guid {} max_qp {} max_qp_wr {} max_cqe {} max_sge {}",
        d.name, d.fw_ver, d.node_guid, d.max_qp, d.max_qp_wr, d.max_cqe, d.max_sge
    );
    if d.srq() {
        println!(
            "  srq: yes (max_srq {}, max_srq_wr {}, max_srq_sge {})",
            d.max_srq, d.max_srq_wr, d.max_srq_sge
        );
    } else {
        println!("  srq: no");
    }
    for port in &d.ports {
        println!(
            "  port {}: {}, active_mtu {} (max {}), link_layer {}, lid {}, {} GIDs",
            port.port,
            port.state,
            port.active_mtu,
            port.max_mtu,
            port.link_layer,
            port.lid,
            port.gids.len()
        );
        for g in &port.gids {
            println!("    gid {g}");
        }
    }
}

fn print_plan(p: &ipoib_ctl::plan::Plan) {
    use ipoib_ctl::{
        plan::{self, PlanKind},
        policy::format_size,
    };
    let model = match p.kind {
        PlanKind::Srq => format!("one SRQ of {} buffers", p.ring),
        PlanKind::PerConnection => format!(
            "a ring of {} buffers per connection, at most {} rings (K)",
            p.ring, p.max_cm_peers
        ),
        PlanKind::UdOnly => "none (UD only)".into(),
    };
    println!(
        "  memory plan ({:?}): {}
    receive model: {model}
    uses {} of a {} budget ({}); \
         buffer {} B, cm mtu {}",
        p.kind,
        p.why,
        format_size(p.memory_bytes),
        format_size(p.budget_bytes),
        p.budget_source,
        p.buffer_bytes,
        p.cm_mtu
    );
    println!(
        "    the kernel: {} with SRQ; without SRQ {} at 4096 peers",
        format_size(plan::kernel_memory(4096, true)),
        format_size(plan::kernel_memory(4096, false))
    );
}

/// The completion script for `shell` on stdout.
fn completions(shell: clap_complete::Shell) -> ExitCode {
    use clap::CommandFactory as _;
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "ipoib-ctl", &mut script);
    let mut script = String::from_utf8_lossy(&script).into_owned();
    if shell == clap_complete::Shell::Bash {
        // clap_complete 4.6 spells a hyphenated binary's subcommand states two ways, so no
        // subcommand's options complete (clap-rs/clap#6421, open); spell them as its loop does.
        script = script.replace("ipoib__subcmd__ctl__", "ipoib__ctl__");
    }
    print!("{script}");
    ExitCode::SUCCESS
}

/// The man page ipoib-ctl(8), or ipoib-ctl-SUB(8) of one subcommand (as git's and cargo's),
/// in roff on stdout.
fn man_page(sub: Option<&str>) -> ExitCode {
    use clap::CommandFactory as _;
    let cli = Cli::command();
    let cmd = match sub {
        None => cli,
        Some(name) => match cli.find_subcommand(name) {
            Some(c) => {
                let full = format!("ipoib-ctl-{name}");
                c.clone().name(full).version(env!("CARGO_PKG_VERSION"))
            }
            None => {
                eprintln!("ipoib-ctl: no subcommand `{name}`");
                return ExitCode::from(exit::BAD_INPUT);
            }
        },
    };
    let mut out = Vec::new();
    let written = clap_mangen::Man::new(cmd)
        .section("8")
        .render(&mut out)
        .and_then(|()| std::io::Write::write_all(&mut std::io::stdout(), &out));
    match written {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ipoib-ctl: writing the man page: {e}");
            ExitCode::from(exit::FAILURE)
        }
    }
}

/// stderr is the journal's stream (systemd set `JOURNAL_STREAM` to its device and inode):
/// log to journald natively then, with priorities, as systemd documents.
fn stderr_is_journal() -> bool {
    use std::os::unix::fs::MetadataExt as _;
    let Some(want) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Ok(fd) = std::os::fd::AsFd::as_fd(&std::io::stderr()).try_clone_to_owned() else {
        return false;
    };
    File::from(fd)
        .metadata()
        .is_ok_and(|m| want.to_str() == Some(&format!("{}:{}", m.dev(), m.ino())))
}

/// Logs: `RUST_LOG` filters (default `info`); to journald where stderr is the journal's
/// stream, else to stderr, coloured only on a terminal. True when journald takes them.
fn init_logs() -> bool {
    use std::io::IsTerminal as _;
    use tracing_subscriber::{EnvFilter, layer::SubscriberExt as _, util::SubscriberInitExt as _};
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let journald = stderr_is_journal()
        .then(tracing_journald::layer)
        .and_then(Result::ok)
        .map(|l| {
            use tracing_journald::{Priority, PriorityMappings};
            // syslog's levels: info is 6 and debug 7 (the crate's default puts info at 5).
            l.with_syslog_identifier("ipoib-ctl".to_owned())
                .with_priority_mappings(PriorityMappings {
                    info: Priority::Informational,
                    debug: Priority::Debug,
                    ..PriorityMappings::new()
                })
        });
    let to_journal = journald.is_some();
    let fmt = (!to_journal).then(|| {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
    });
    tracing_subscriber::registry()
        .with(filter)
        .with(journald)
        .with(fmt)
        .init();
    to_journal
}

/// `doctor`: the report, its exit code the worst line's.
fn doctor(iface: Option<&str>, json: bool) -> ExitCode {
    let checks = ipoib_ctl::doctor::judge(&ipoib_ctl::doctor::gather(iface));
    if json {
        if let Err(e) = print_json(&checks) {
            eprintln!("ipoib-ctl: {e:#}");
            return ExitCode::from(exit::FAILURE);
        }
    } else {
        print!("{}", ipoib_ctl::doctor::render(&checks));
    }
    ExitCode::from(ipoib_ctl::doctor::worst(&checks).exit_code())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Neither needs root: they print what the command line is.
    match &cli.cmd {
        Cmd::Completions { shell } => return completions(*shell),
        Cmd::Man { subcommand } => return man_page(subcommand.as_deref()),
        _ => {}
    }
    let journal = init_logs();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!(
            "ipoib-ctl: needs root (it loads eBPF programs and reads pins under {}, mode 0700)",
            attach::PIN_ROOT
        );
        return ExitCode::from(exit::NO_PRIVILEGE);
    }
    if let Cmd::Doctor { iface, json } = &cli.cmd {
        return doctor(iface.as_deref(), *json);
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if journal {
                // At the error's priority, not as a line of the stream.
                tracing::error!("{e:#}");
            } else {
                eprintln!("ipoib-ctl: {e:#}");
            }
            ExitCode::from(exit::code(e.chain()))
        }
    }
}
