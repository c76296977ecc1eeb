//! The exit codes scripts can rely on, and which error gives which: each error type says its
//! own ([`code`] walks an error's chain and takes the first that names one).

use std::error::Error;

use crate::{
    attach::AttachError, config::ConfigError, connmgr::CmError, datapath::DatapathError,
    iblink::LinkError, netdev::NetdevError, policy::PolicyError, verbs::VerbsError,
};

pub const FAILURE: u8 = 1;
/// Bad input: nothing was changed (clap's own usage errors also exit 2).
pub const BAD_INPUT: u8 = 2;
/// Not root, or the kernel refused BPF.
pub const NO_PRIVILEGE: u8 = 3;
/// The interface is not attached.
pub const NOT_ATTACHED: u8 = 4;
/// No RDMA device (or no RDMA support in this kernel).
pub const NO_RDMA: u8 = 5;

/// The codes, as `--help` says them.
pub const EXIT_CODES: &str = "Exit codes: 0 ok, 1 failure, 2 bad input (nothing changed), \
                              3 not root or no BPF, 4 interface not attached, 5 no RDMA device.";

/// The code of an error chain (the error, then its sources): the first that names one, else
/// [`FAILURE`].
pub fn code<'a>(chain: impl IntoIterator<Item = &'a (dyn Error + 'static)>) -> u8 {
    chain.into_iter().find_map(code_of).unwrap_or(FAILURE)
}

/// The code one error names, if it names one.
fn code_of(e: &(dyn Error + 'static)) -> Option<u8> {
    if let Some(v) = e.downcast_ref::<VerbsError>() {
        return v.exit_code();
    }
    if let Some(n) = e.downcast_ref::<NetdevError>() {
        return Some(n.exit_code());
    }
    if e.is::<PolicyError>() || e.is::<LinkError>() {
        return Some(BAD_INPUT);
    }
    if let Some(c) = e.downcast_ref::<CmError>() {
        return c.exit_code();
    }
    if let Some(a) = e.downcast_ref::<AttachError>() {
        return a.exit_code();
    }
    e.downcast_ref::<ConfigError>().map(ConfigError::exit_code)
}

impl VerbsError {
    /// No RDMA here at all is its own code; other verbs failures are failures.
    pub fn exit_code(&self) -> Option<u8> {
        matches!(self, VerbsError::NoKernelSupport(_) | VerbsError::NoDevices).then_some(NO_RDMA)
    }
}

impl NetdevError {
    /// A name that is wrong or an interface of the wrong kind is bad input; the rest (a query
    /// that failed, an interface that is down) may pass.
    pub fn exit_code(&self) -> u8 {
        if self.is_permanent() {
            BAD_INPUT
        } else {
            FAILURE
        }
    }
}

impl CmError {
    /// A device, port or partition named that is not there is bad input.
    pub fn exit_code(&self) -> Option<u8> {
        matches!(
            self,
            CmError::NoDevice(_) | CmError::NoPort { .. } | CmError::NoPartition { .. }
        )
        .then_some(BAD_INPUT)
    }
}

impl AttachError {
    pub fn exit_code(&self) -> Option<u8> {
        match self {
            AttachError::NotAttached { .. } => Some(NOT_ATTACHED),
            AttachError::Policy(_) => Some(BAD_INPUT),
            AttachError::Netdev(n) => Some(n.exit_code()),
            AttachError::Datapath(DatapathError::Object(_)) => Some(NO_PRIVILEGE),
            _ => None,
        }
    }
}

impl ConfigError {
    pub fn exit_code(&self) -> u8 {
        match self {
            ConfigError::Link(_) => BAD_INPUT,
            ConfigError::Netdev(n) => n.exit_code(),
            ConfigError::NotIpoib { .. } | ConfigError::NoIpv4 { .. } => FAILURE,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error that wraps another (as anyhow's context does), for a chain of two.
    #[derive(Debug, thiserror::Error)]
    #[error("while doing something")]
    struct Context(#[source] Box<dyn Error + Send + Sync + 'static>);

    fn chain_of(e: &(dyn Error + 'static)) -> u8 {
        let mut chain = vec![e];
        while let Some(next) = chain[chain.len() - 1].source() {
            chain.push(next);
        }
        code(chain)
    }

    #[test]
    fn each_error_says_its_code_through_a_chain() {
        let io = || std::io::Error::other("x");
        let cases: Vec<(Box<dyn Error + Send + Sync>, u8)> = vec![
            (Box::new(VerbsError::NoDevices), NO_RDMA),
            (Box::new(NetdevError::NotFound("ib9".into())), BAD_INPUT),
            (Box::new(NetdevError::Down { name: "ib0".into() }), FAILURE),
            (Box::new(CmError::NoDevice("mlx5_9".into())), BAD_INPUT),
            (
                Box::new(AttachError::NotAttached {
                    iface: "ib0".into(),
                    dir: "/x".into(),
                }),
                NOT_ATTACHED,
            ),
            (
                Box::new(AttachError::Netdev(NetdevError::BadName("a/b".into()))),
                BAD_INPUT,
            ),
            (
                Box::new(ConfigError::NoIpv4 {
                    iface: "eth1".into(),
                }),
                FAILURE,
            ),
            (
                Box::new(ConfigError::Netdev(NetdevError::NotFound("x".into()))),
                BAD_INPUT,
            ),
            (Box::new(io()), FAILURE),
        ];
        for (e, want) in cases {
            let said = e.to_string();
            assert_eq!(chain_of(e.as_ref()), want, "{said}");
            let wrapped = Context(e);
            assert_eq!(chain_of(&wrapped), want, "in a chain: {said}");
        }
    }
}
