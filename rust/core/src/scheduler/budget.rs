//! A step's token budget, as vLLM's scheduler keeps it: the tokens left to schedule, and the
//! input slots left, which every scheduled request also charges its drafting slots to
//! (`max_num_new_slots_for_drafting`: K for DFlash in vLLM 0.32, 0 otherwise).

/// The two budgets of one step (vLLM's `token_budget` and `input_budget`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepBudget {
    /// Tokens that may still be scheduled.
    pub(crate) tokens: usize,
    /// Input slots left: scheduled tokens plus `draft_slots` per scheduled request.
    inputs: usize,
    /// Slots each scheduled request takes beyond its tokens.
    draft_slots: usize,
}

impl StepBudget {
    /// A full budget of `max_num_batched_tokens`.
    pub(crate) fn new(max_num_batched_tokens: usize, draft_slots: usize) -> Self {
        Self {
            tokens: max_num_batched_tokens,
            inputs: max_num_batched_tokens,
            draft_slots,
        }
    }

    /// Whether one more request can be scheduled (vLLM: `token_budget > 0` and
    /// `input_budget > draft_slots`).
    pub(crate) fn can_schedule(&self) -> bool {
        self.tokens > 0 && self.inputs > self.draft_slots
    }

    /// The most tokens the next request may get (vLLM: `min(token_budget, input_budget -
    /// draft_slots)`); 0 when `can_schedule` is false.
    pub(crate) fn cap(&self) -> usize {
        self.tokens
            .min(self.inputs.saturating_sub(self.draft_slots))
    }

    /// Charges a request scheduled with `num_tokens` tokens.
    pub(crate) fn take(&mut self, num_tokens: usize) {
        debug_assert!(num_tokens <= self.cap());
        self.tokens -= num_tokens;
        self.inputs -= num_tokens + self.draft_slots;
    }

    /// Refunds a request unscheduled within the step (a preempted victim).
    pub(crate) fn give_back(&mut self, num_tokens: usize) {
        self.tokens += num_tokens;
        self.inputs += num_tokens + self.draft_slots;
    }
}

#[cfg(test)]
mod tests {
    use super::StepBudget;

    #[test]
    fn without_draft_slots_both_budgets_are_the_token_budget() {
        let mut b = StepBudget::new(10, 0);
        assert_eq!(b.cap(), 10);
        b.take(7);
        assert!(b.can_schedule());
        assert_eq!(b.cap(), 3);
        b.take(3);
        assert!(!b.can_schedule());
        b.give_back(7);
        assert_eq!(b.cap(), 7);
    }

    #[test]
    fn each_scheduled_request_also_takes_its_draft_slots() {
        // vLLM 0.32 DFlash, K = 3: a budget of 16 holds 4 decodes of one token.
        let mut b = StepBudget::new(16, 3);
        assert_eq!(b.cap(), 13);
        for left in [9, 5, 1] {
            b.take(1);
            assert_eq!(b.cap(), left);
        }
        b.take(1);
        assert_eq!(b.tokens, 12);
        assert!(!b.can_schedule(), "inputs 0 <= 3 draft slots");
        b.give_back(1);
        assert!(b.can_schedule());
        assert_eq!(b.cap(), 1);
    }
}
