//! Kubernetes name rules (namespaces, label and annotation keys and values), for configuration that
//! names objects: an invalid name is refused at start-up instead of by the API on every pass.

/// Why a name, key or value is not one Kubernetes accepts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("it is empty")]
    Empty,
    #[error("it is {length} characters long, at most {limit} are allowed")]
    TooLong { length: usize, limit: usize },
    #[error("only lowercase letters, digits and '-' are allowed")]
    LabelCharacters,
    #[error("only lowercase letters, digits, '-' and '.' are allowed")]
    SubdomainCharacters,
    #[error("only letters, digits, '-', '_' and '.' are allowed")]
    NameCharacters,
    #[error("it must start and end with a letter or digit")]
    Ends,
    #[error("it has an empty part between dots")]
    EmptyPart,
    #[error("each part must start and end with a letter or digit")]
    PartEnds,
    #[error("the name part must be 1-63 characters")]
    NameLength,
    #[error("its prefix is invalid: {0}")]
    Prefix(Box<NameError>),
}

/// RFC 1123 label, as Kubernetes validates namespace names.
pub fn validate_dns1123_label(name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if name.len() > 63 {
        return Err(NameError::TooLong {
            length: name.len(),
            limit: 63,
        });
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
    {
        return Err(NameError::LabelCharacters);
    }
    if name.starts_with('-') || name.ends_with('-') {
        return Err(NameError::Ends);
    }
    Ok(())
}

/// RFC 1123 subdomain, as Kubernetes validates a label key's prefix.
pub fn validate_dns1123_subdomain(name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if name.len() > 253 {
        return Err(NameError::TooLong {
            length: name.len(),
            limit: 253,
        });
    }
    for label in name.split('.') {
        if label.is_empty() {
            return Err(NameError::EmptyPart);
        }
        if !label
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        {
            return Err(NameError::SubdomainCharacters);
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err(NameError::PartEnds);
        }
    }
    Ok(())
}

/// A label or annotation key: an optional DNS subdomain prefix and `/`, then a name.
pub fn validate_qualified_name(key: &str) -> Result<(), NameError> {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if let Some(prefix) = prefix {
        validate_dns1123_subdomain(prefix).map_err(|why| NameError::Prefix(Box::new(why)))?;
    }
    validate_label_name(name)
}

/// 1-63 letters, digits, `-`, `_` or `.`, starting and ending with a letter or digit.
pub fn validate_label_name(name: &str) -> Result<(), NameError> {
    if name.is_empty() || name.len() > 63 {
        return Err(NameError::NameLength);
    }
    let alnum = |c: char| c.is_ascii_alphanumeric();
    if !name.starts_with(alnum) || !name.ends_with(alnum) {
        return Err(NameError::Ends);
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return Err(NameError::NameCharacters);
    }
    Ok(())
}

/// A label value: empty, or a valid label name.
pub fn validate_label_value(value: &str) -> Result<(), NameError> {
    if value.is_empty() {
        return Ok(());
    }
    validate_label_name(value)
}
