//! The simulated upstream: text-to-speech as chunks of "audio" (the hex of each
//! piece of text), and the `[fail-after:N]` marker that makes it fail.

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
/// chunks (after the last one, if there are fewer).
pub fn fail_after(text: &str) -> Option<usize> {
    let start = text.find("[fail-after:")? + "[fail-after:".len();
    let rest = &text[start..];
    let end = rest.find(']')?;
    rest[..end].parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_marker_and_the_chunks() {
        assert_eq!(fail_after("say [fail-after:2] this"), Some(2));
        assert_eq!(fail_after("say [fail-after:x] this"), None);
        assert_eq!(fail_after("plain"), None);
        let c = chunks(&"é".repeat(17));
        assert_eq!(c.len(), 2);
        assert_eq!(c[0].characters, 16);
        assert_eq!(c[1].audio, "c3a9");
    }
}
