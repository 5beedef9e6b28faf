//! When to stop generating: the end of a function call, the end of the model's turn, an EOS id
//! of the config, or the maximum number of new tokens.

use std::fmt;

use kvsnap_contract::ModelConfig;

/// Closes a function call. A FunctionGemma tokenizer has it as one token; the base Gemma 3
/// tokenizer spells it with several, so it is matched on the decoded text.
pub const END_FUNCTION_CALL: &str = "<end_function_call>";
/// Closes a turn (one special token in every Gemma 3 tokenizer).
pub const END_OF_TURN: &str = "<end_of_turn>";

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The decoded output contains `<end_function_call>`.
    EndFunctionCall,
    /// The model produced `<end_of_turn>`.
    EndOfTurn,
    /// The model produced an EOS id of its config.
    Eos(u32),
    /// `max_new_tokens` were generated without another rule firing.
    MaxNewTokens(usize),
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StopReason::EndFunctionCall => write!(f, "at {END_FUNCTION_CALL}"),
            StopReason::EndOfTurn => write!(f, "at {END_OF_TURN}"),
            StopReason::Eos(id) => write!(f, "at EOS (id {id})"),
            StopReason::MaxNewTokens(n) => write!(f, "at the limit of {n} new tokens"),
        }
    }
}

/// The stopping rules of one generation, checked after every generated token.
#[derive(Clone, Debug, PartialEq)]
pub struct StopRules {
    /// Id of `<end_of_turn>`, when the tokenizer has it.
    pub end_of_turn: Option<u32>,
    /// EOS ids (the config's `eos_token_id`).
    pub eos: Vec<u32>,
    /// Stop once the decoded output contains `<end_function_call>`.
    pub end_function_call: bool,
    /// At most this many generated tokens (at least 1).
    pub max_new_tokens: usize,
}

impl StopRules {
    /// Every rule on: `<end_function_call>`, `<end_of_turn>` (`end_of_turn` id), the config's EOS
    /// ids, and `max_new_tokens`.
    pub fn new(cfg: &ModelConfig, end_of_turn: Option<u32>, max_new_tokens: usize) -> Self {
        StopRules {
            end_of_turn,
            eos: cfg.eos_token_ids.clone(),
            end_function_call: true,
            max_new_tokens: max_new_tokens.max(1),
        }
    }

    /// Checks the rules after `generated` (all tokens generated so far, the newest last) whose
    /// decoded text is `text`. The end of a call wins over the token rules (its last token may
    /// be an EOS id in a FunctionGemma vocabulary), `<end_of_turn>` over the EOS ids that
    /// include it, and every rule over the token limit.
    pub fn check(&self, generated: &[u32], text: &str) -> Option<StopReason> {
        let last = *generated.last()?;
        if self.end_function_call && text.contains(END_FUNCTION_CALL) {
            return Some(StopReason::EndFunctionCall);
        }
        if self.end_of_turn == Some(last) {
            return Some(StopReason::EndOfTurn);
        }
        if self.eos.contains(&last) {
            return Some(StopReason::Eos(last));
        }
        if generated.len() >= self.max_new_tokens {
            return Some(StopReason::MaxNewTokens(self.max_new_tokens));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules() -> StopRules {
        StopRules {
            end_of_turn: Some(106),
            eos: vec![1, 106],
            end_function_call: true,
            max_new_tokens: 4,
        }
    }

    #[test]
    fn each_rule_fires_and_the_order_is_documented() {
        let r = rules();
        assert_eq!(r.check(&[], ""), None);
        assert_eq!(r.check(&[7], "x"), None);
        assert_eq!(
            r.check(&[7, 8], "x<end_function_call>"),
            Some(StopReason::EndFunctionCall)
        );
        assert_eq!(r.check(&[7, 106], "x"), Some(StopReason::EndOfTurn));
        assert_eq!(r.check(&[7, 1], "x"), Some(StopReason::Eos(1)));
        assert_eq!(
            r.check(&[7, 8, 9, 10], "x"),
            Some(StopReason::MaxNewTokens(4))
        );
        assert_eq!(
            r.check(&[7, 8, 9, 1], "x"),
            Some(StopReason::Eos(1)),
            "a stop token beats the limit"
        );
        let off = StopRules {
            end_function_call: false,
            ..rules()
        };
        assert_eq!(off.check(&[7], "<end_function_call>"), None);
    }
}
