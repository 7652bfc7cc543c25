"""TRL conversational preference records for the preference tests (prompt, chosen,
rejected, images; real image files from ``tests.conversation_data``)."""


def pair_record(i: int) -> dict:
    """Record ``p<i>``: a prompt with 0, 1 or 2 images and two different answers."""
    images = [[], ["a.png"], ["a.png", "b.jpg"]][i % 3]
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "which digit?"}]
    answers = ["seven.", "two.", "a digit is this? seven."]
    return {
        "id": f"p{i}",
        "prompt": [{"role": "user", "content": content}],
        "chosen": [{"role": "assistant", "content": answers[i % 3]}],
        "rejected": [{"role": "assistant", "content": answers[(i + 1) % 3]}],
        "images": images,
    }


MULTI_TURN = {
    "id": "multi",
    "prompt": [
        {"role": "system", "content": "be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "which?"}]},
        {"role": "assistant", "content": "seven."},
        {"role": "user", "content": "and now?"},
    ],
    "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "two."}]}],
    "rejected": [{"role": "assistant", "content": "seven."}],
    "images": ["b.jpg"],
}
