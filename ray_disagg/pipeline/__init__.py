"""The cross-group pipeline as data: which replica gets which samples (assignment), each
side's ordered actions for a step (schedule) and the messages they exchange."""
