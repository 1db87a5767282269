"""The codec's plan in the engine's loop (`engine.codec_plan.plan_codec`), without a model or a codec: what each pass
decodes of which stream, in which calls, light and under load."""

from s2tts.engine.codec_plan import Slice, StreamView, Take, plan_codec


def view(key, undecoded=0, need=0, released=0, ended=False, closes=True, open=True, ended_at=None, first_at=None):
    """A stream whose waiting chunks need `need` frames decoded (no audio held); `ended`: its final item routed (at
    pass `ended_at`, 0 by default); `first_at`: the pass its first chunk was routed."""
    return StreamView(key, undecoded, waiting=need, audio=0, released=released, closes=closes, open=open,
                      ended_at=(ended_at if ended_at is not None else 0) if ended else None, first_at=first_at)


def whole(n, final):
    return [n]


def plan(streams, passes=1, batch_steps=1, under_load=False, engine_idle=False, final_steps=0, first_steps=0,
         slices=whole):
    return plan_codec(streams, passes=passes, batch_steps=batch_steps, under_load=under_load, engine_idle=engine_idle,
                      final_steps=final_steps, first_steps=first_steps, slices=slices)


def test_light_load_decodes_what_the_waiting_chunks_need_all_streams_in_one_call():
    p = plan([view(1, undecoded=3, need=2, open=False), view(2, undecoded=5, need=5), view(3, undecoded=4, need=0)])
    assert p.takes == (Take(1, 2, opens=True, closes=False), Take(2, 5, opens=False, closes=False))
    assert p.calls == ((Slice(1, 0, 2, start=True, final=False), Slice(2, 0, 5, start=False, final=False)),)
    assert not p.held


def test_under_load_whole_slices_every_k_passes_and_nothing_between():
    streams = [view(1, undecoded=9, need=6, released=8), view(2, undecoded=3, need=3, released=8)]
    assert not plan(streams, passes=5, batch_steps=4, under_load=True).takes  # between held calls
    p = plan(streams, passes=8, batch_steps=4, under_load=True)
    assert p.held and p.takes == (Take(1, 8, opens=False, closes=False),)  # 2 whole slices of 4; stream 2 has none
    # the engine out of work: the held call comes at once
    assert plan(streams, passes=5, batch_steps=4, under_load=True, engine_idle=True).takes[0].frames == 8


def test_a_stream_short_of_audio_brings_the_held_call_forward_and_gets_what_it_needs():
    """A stream that has sent fewer than K frames of audio with a chunk complete: the codec runs now, and that stream
    gets at least what its chunks need (its client could run dry before the next held call)."""
    streams = [view(1, undecoded=3, need=3, released=2), view(2, undecoded=9, need=0, released=12)]
    p = plan(streams, passes=5, batch_steps=4, under_load=True)
    assert p.takes == (Take(1, 3, opens=False, closes=False), Take(2, 8, opens=False, closes=False))
    # no chunk complete yet: no call
    assert not plan([view(1, undecoded=3, need=0, released=2)], passes=5, batch_steps=4, under_load=True).takes


def test_an_ended_request_decodes_all_it_has_and_closes_its_stream_unless_a_later_request_continues_it():
    p = plan([view(1, undecoded=5, need=3, ended=True), view(2, undecoded=2, need=2, ended=True, closes=False)])
    assert p.takes == (Take(1, 5, opens=False, closes=True), Take(2, 2, opens=False, closes=False))
    assert [s.final for s in p.calls[0]] == [True, False]
    # nothing left to decode and its stream open: one empty slice closes it; a stream never opened needs nothing,
    # unless a later request continues it: one empty slice opens it
    p = plan([view(1, ended=True), view(2, ended=True, open=False), view(3, ended=True, open=False, closes=False)])
    assert p.takes == (Take(1, 0, opens=False, closes=True), Take(3, 0, opens=True, closes=False))
    assert p.calls == ((Slice(1, 0, 0, False, True), Slice(3, 0, 0, True, False)),)


def test_between_held_calls_only_requests_that_ended_final_steps_ago_are_decoded():
    streams = [view(1, undecoded=5, need=5, released=8, ended=True, ended_at=9),
               view(2, undecoded=3, need=2, released=8, ended=True, ended_at=10),
               view(3, undecoded=6, need=6, released=8)]
    p = plan(streams, passes=10, batch_steps=8, under_load=True, final_steps=1)
    assert [t.key for t in p.takes] == [1] and p.takes[0].frames == 5
    assert [t.key for t in plan(streams, passes=10, batch_steps=8, under_load=True, final_steps=0).takes] == [1, 2]
    assert not plan(streams, passes=10, batch_steps=8, under_load=True, final_steps=8).takes  # they wait for the held call


def test_between_held_calls_a_first_chunk_due_is_decoded_with_the_finished_requests():
    """A stream that has sent no audio, its first chunk complete since pass 9: decoded `first_steps` passes later (0:
    at once) in the call of the requests that ended, with whole slices of K where it has them; never before its
    chunk is complete, and with `first_steps` >= K only in the held call."""
    streams = [view(1, undecoded=8, need=8, first_at=9, open=False),
               view(2, undecoded=5, need=5, released=8, ended=True, ended_at=10),
               view(3, undecoded=6, need=0, first_at=None, open=False),  # its first chunk not made yet
               view(4, undecoded=8, need=8, released=16, first_at=2)]  # past its second chunk: the held call's
    p = plan(streams, passes=10, batch_steps=8, under_load=True, first_steps=0)
    assert p.takes == (Take(1, 8, opens=True, closes=False), Take(2, 5, opens=False, closes=True))
    assert p.calls == ((Slice(1, 0, 8, start=True, final=False), Slice(2, 0, 5, start=False, final=True)),)
    assert [t.key for t in plan(streams, passes=10, batch_steps=8, under_load=True, first_steps=2).takes] == [2]
    assert [t.key for t in plan(streams, passes=11, batch_steps=8, under_load=True, first_steps=2).takes] == [1, 2]
    assert [t.key for t in plan(streams, passes=15, batch_steps=8, under_load=True, first_steps=8).takes] == [2]
    # its second chunk too, once complete: its client holds one chunk's audio, which a held call up to 2 K - 1
    # passes away could outlast; from its third on, the held calls'
    second = [view(5, undecoded=9, need=8, released=8, first_at=2), view(6, undecoded=9, need=8, released=16,
                                                                          first_at=2)]
    assert plan(second, passes=10, batch_steps=8, under_load=True).takes == (Take(5, 8, opens=False, closes=False),)
    assert not plan(second, passes=10, batch_steps=8, under_load=True, first_steps=8).takes
    # alone, it is a call of its own; with both waits at K or more, nothing goes between held calls
    assert [t.key for t in plan(streams[:1], passes=10, batch_steps=8, under_load=True).takes] == [1]
    assert not plan(streams, passes=10, batch_steps=8, under_load=True, first_steps=8, final_steps=8).takes


def test_a_take_the_codec_cannot_decode_in_one_length_goes_in_several_calls_in_order():
    def slices(n, final):
        return [4] * (n // 4) + ([n % 4] if n % 4 else [])

    p = plan([view(1, undecoded=10, need=10, open=False, ended=True), view(2, undecoded=4, need=4)], slices=slices)
    assert p.calls == (
        (Slice(1, 0, 4, start=True, final=False), Slice(2, 0, 4, start=False, final=False)),
        (Slice(1, 4, 4, start=False, final=False),),
        (Slice(1, 8, 2, start=False, final=True),),
    )
