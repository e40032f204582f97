"""The hand-composed steps of the tiny Qwen2.5-Omni tests (`test_omni_audio.py`,
`test_omni_eval.py`) over the records of ``make_omni_dataset(root, videos=2)``: every modality,
then no audio, then no image (so each module once gets no input)."""

# record indices of `test_omni_audio.omni_records`: images, text-only, audio clips, image + audio, videos
IMG, TXT, AUD, BOTH, VID = (0, 1, 3, 4), (2, 5), (6, 7, 8, 9), 10, (11, 12)
STEPS = (
    ((IMG[0], AUD[0], BOTH, TXT[0]), (IMG[1], AUD[1], VID[0], AUD[2])),  # every modality
    ((IMG[3], TXT[0], VID[1], TXT[1]), (IMG[1], TXT[1], IMG[2], TXT[0])),  # no audio
    ((AUD[0], TXT[0], AUD[3], TXT[1]), (AUD[1], AUD[2], TXT[0], AUD[3])),  # no image
)
