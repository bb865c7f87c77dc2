//! Telling cluster paths (`ff:/a/b`) from local ones.

/// A `cp` endpoint.
#[derive(Debug, PartialEq, Eq)]
pub enum Endpoint {
    Cluster(String),
    Local(std::path::PathBuf),
}

/// `ff:/x` is a cluster path, anything else local.
pub fn endpoint(text: &str) -> Endpoint {
    match text.strip_prefix("ff:") {
        Some(rest) => Endpoint::Cluster(cluster_path(rest)),
        None => Endpoint::Local(text.into()),
    }
}

/// A path inside the namespace, for commands that only take cluster paths: `ff:` is optional
/// and a relative path is taken from the root.
pub fn cluster_path(text: &str) -> String {
    let text = text.strip_prefix("ff:").unwrap_or(text);
    if text.starts_with('/') {
        text.to_string()
    } else {
        format!("/{text}")
    }
}

/// Parse a size like `4096`, `64K`, `1M`.
pub fn parse_size(text: &str) -> Option<u64> {
    let text = text.trim();
    let (digits, multiplier) = match text.char_indices().last()? {
        (at, 'K' | 'k') => (&text[..at], 1 << 10),
        (at, 'M' | 'm') => (&text[..at], 1 << 20),
        (at, 'G' | 'g') => (&text[..at], 1 << 30),
        _ => (text, 1),
    };
    digits.parse::<u64>().ok()?.checked_mul(multiplier)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_and_sizes() {
        assert_eq!(endpoint("ff:/a/b"), Endpoint::Cluster("/a/b".into()));
        assert_eq!(endpoint("ff:a"), Endpoint::Cluster("/a".into()));
        assert_eq!(endpoint("./ff:x"), Endpoint::Local("./ff:x".into()));
        assert_eq!(cluster_path("x/y"), "/x/y");
        assert_eq!(parse_size("64K"), Some(65536));
        assert_eq!(parse_size("1M"), Some(1 << 20));
        assert_eq!(parse_size("12"), Some(12));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size(""), None);
    }
}
