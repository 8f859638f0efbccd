//! The simulated upstream: text-to-speech as chunks of "audio" (the hex of each
//! piece of text), and, in a build with the `test-hooks` feature only, the
//! `[fail-after:N]` marker that makes it fail.

/// Characters of text per chunk.
pub const CHUNK_CHARS: usize = 16;

/// One chunk of the simulated audio.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Characters of the text it covers.
    pub characters: usize,
    /// The "audio": the hex of the text piece's UTF-8 bytes.
    pub audio: String,
}

/// The chunks of `text`: one per 16 characters.
pub fn chunks(text: &str) -> Vec<Chunk> {
    let chars: Vec<char> = text.chars().collect();
    chars
        .chunks(CHUNK_CHARS)
        .map(|piece| {
            let s: String = piece.iter().collect();
            Chunk {
                characters: piece.len(),
                audio: s.bytes().map(|b| format!("{b:02x}")).collect(),
            }
        })
        .collect()
}

/// `Some(N)` when the text holds `[fail-after:N]`: the upstream fails after N
/// chunks (after the last one, if there are fewer). A test hook: only a build with
/// the `test-hooks` feature reads the marker.
#[cfg(feature = "test-hooks")]
pub fn fail_after(text: &str) -> Option<usize> {
    let start = text.find("[fail-after:")? + "[fail-after:".len();
    let rest = &text[start..];
    let end = rest.find(']')?;
    rest[..end].parse().ok()
}

/// Without the `test-hooks` feature the marker is text like any other.
#[cfg(not(feature = "test-hooks"))]
pub fn fail_after(_text: &str) -> Option<usize> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "test-hooks")]
    #[test]
    fn the_marker_with_test_hooks() {
        assert_eq!(fail_after("say [fail-after:2] this"), Some(2));
        assert_eq!(fail_after("say [fail-after:x] this"), None);
        assert_eq!(fail_after("plain"), None);
    }

    #[cfg(not(feature = "test-hooks"))]
    #[test]
    fn a_default_build_ignores_the_marker() {
        assert_eq!(fail_after("say [fail-after:2] this"), None);
    }

    #[test]
    fn the_chunks() {
        let c = chunks(&"é".repeat(17));
        assert_eq!(c.len(), 2);
        assert_eq!(c[0].characters, 16);
        assert_eq!(c[1].audio, "c3a9");
    }
}
