//! Value types and their parsers: service ranges, numbers, lists (the node port range is
//! [`reconcilers::alloc::PortRange`]).

use ipnet::IpNet;
use serde::Deserialize;

/// A number of the type the setting takes; `Err` holds the text that is no such number, for the
/// message.
pub(super) fn parse_number<T: std::str::FromStr>(text: &str) -> Result<T, NotANumber> {
    text.trim()
        .parse::<T>()
        .map_err(|_| NotANumber(text.to_owned()))
}

/// Parses a boolean flag or variable: `true` or `false`, as clap's own parser took them. Parsed
/// here rather than by clap so that a bad value is reported with the others, naming the variable
/// when it came from the environment.
pub(super) fn parse_bool(text: &str) -> Result<bool, String> {
    match text.trim() {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(format!(
            "{text:?} is not a boolean (expected true or false)"
        )),
    }
}

/// A flag's text that is not a number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotANumber(pub String);

/// `serviceClusterIPRange` (and the other lists) may be written `"a,b"` (like the flag) or as a
/// YAML list.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum StringOrList {
    One(String),
    List(Vec<String>),
}

/// The file's list as the flag writes it.
impl From<StringOrList> for String {
    fn from(list: StringOrList) -> String {
        match list {
            StringOrList::One(one) => one,
            StringOrList::List(list) => list.join(","),
        }
    }
}

/// Parses `--service-cluster-ip-range`: one CIDR, or two of different families, each holding at
/// least 8 addresses (kube-apiserver's rules, checked by
/// [`reconcilers::service_range::validate_ranges`]). The error says what was expected.
pub fn parse_service_cidrs(text: &str) -> Result<Vec<IpNet>, String> {
    let parts: Vec<&str> = text.split(',').map(str::trim).collect();
    if parts.iter().all(|part| part.is_empty()) {
        return Err(
            "is empty (expected one CIDR such as 10.96.0.0/12, or two of different \
                    families such as 10.96.0.0/12,fd00:10:96::/108)"
                .to_owned(),
        );
    }
    let mut cidrs = Vec::with_capacity(parts.len());
    for part in parts {
        let cidr: IpNet = part.parse().map_err(|_| {
            format!("{part:?} is not a valid CIDR (expected e.g. 10.96.0.0/12 or fd00:10:96::/108)")
        })?;
        if cidr.trunc() != cidr {
            let network = cidr.trunc();
            return Err(format!(
                "{part:?} has host bits set (did you mean {network}?)"
            ));
        }
        cidrs.push(cidr);
    }
    reconcilers::service_range::validate_ranges(&cidrs).map_err(|problem| problem.to_string())?;
    Ok(cidrs)
}

/// `a,b`, as the flag takes it.
pub fn format_cidrs(cidrs: &[IpNet]) -> String {
    cidrs
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

pub(super) fn ser_cidrs<S: serde::Serializer>(
    cidrs: &[IpNet],
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&format_cidrs(cidrs))
}
