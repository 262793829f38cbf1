"""A multi-turn chat: each turn's prompt extends the previous one (answers included), so the
radix cache serves the conversation so far; the last answer is streamed as it is produced.

    python clients/examples/multi_turn_chat.py --url localhost:8001
"""
from __future__ import annotations

import argparse

import radixlm
from radixlm import assistant, gen, system, user

TURNS = [
    "I am planning a three-day trip to Lisbon. What should I see on day one?",
    "And on day two, if I like museums?",
    "Suggest a day trip for the third day.",
    "Summarize the plan in one sentence.",
]


@radixlm.function
def chat(s, turns):
    s += system("You are a helpful travel assistant. Keep answers short.")
    for i, turn in enumerate(turns):
        s += user(turn)
        s += assistant(gen(f"answer_{i}", max_tokens=64))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC address")
    parser.add_argument("--model", default="llm")
    args = parser.parse_args(argv)
    radixlm.set_default_backend(radixlm.Triton(args.url, model=args.model))
    state = chat.run(turns=TURNS, stream=True, temperature=0.0)
    for i, turn in enumerate(TURNS):
        print(f"user: {turn}\nassistant: ", end="", flush=True)
        for piece in state.text_iter(f"answer_{i}"):
            print(piece, end="", flush=True)
        meta = state.get_meta_info(f"answer_{i}")
        print(f"\n  [cached {meta['num_cached_tokens']}/{meta['num_input_tokens']} prompt tokens]")
    print(f"{len(state.messages())} messages in the conversation")


if __name__ == "__main__":
    main()
