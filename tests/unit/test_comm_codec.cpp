// Wire encodings of float vectors: exactness of fp32, rounding of bf16, int8
// scales per chunk, and error feedback carrying what rounding lost.
#include "comm/codec.h"
#include "comm/world.h"
#include "train/modes.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>

namespace cfmo::comm {
namespace {

std::vector<float> sample(size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = std::sin(static_cast<float>(i) * 0.37f) * (1.0f + static_cast<float>(i % 7));
  return v;
}

std::vector<float> round_trip(WireDtype dtype, const std::vector<float>& values, std::vector<float>* residual) {
  std::vector<std::byte> bytes;
  encode_floats(dtype, values, residual ? std::span<float>(*residual) : std::span<float>(), bytes);
  EXPECT_EQ(bytes.size(), encoded_size(dtype, values.size()));
  std::vector<float> out(values.size());
  std::span<const std::byte> in(bytes);
  EXPECT_TRUE(decode_floats(dtype, in, out));
  EXPECT_TRUE(in.empty());
  return out;
}

TEST(Codec, Fp32IsExact) {
  const auto v = sample(1000);
  EXPECT_EQ(round_trip(WireDtype::kFp32, v, nullptr), v);
}

TEST(Codec, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 is halfway between two bf16 values: ties go to even (1.0).
  const std::vector<float> v = {1.0f + 0x1p-8f, 1.0f + 0x1p-7f + 0x1p-8f, -2.5f, 0.0f};
  const auto out = round_trip(WireDtype::kBf16, v, nullptr);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], 1.0f + 0x1p-6f);
  EXPECT_EQ(out[2], -2.5f);
  EXPECT_EQ(out[3], 0.0f);
  const auto big = sample(1000);
  const auto approx = round_trip(WireDtype::kBf16, big, nullptr);
  for (size_t i = 0; i < big.size(); ++i) EXPECT_NEAR(approx[i], big[i], std::fabs(big[i]) * 0x1p-8f + 1e-30f);
}

TEST(Codec, Int8UsesOneScalePerChunk) {
  auto v = sample(700);  // three chunks, the last partial
  v[300] = 1000.0f;      // a large value spoils only its own chunk's precision
  const auto out = round_trip(WireDtype::kInt8, v, nullptr);
  for (size_t i = 0; i < 256; ++i) EXPECT_NEAR(out[i], v[i], 8.0f / 127.0f) << i;
  EXPECT_NEAR(out[300], 1000.0f, 1000.0f / 127.0f);
  std::vector<float> zeros(300, 0.0f);
  EXPECT_EQ(round_trip(WireDtype::kInt8, zeros, nullptr), zeros);
}

TEST(Codec, ErrorFeedbackCarriesTheRoundingIntoTheNextMessage) {
  // Sending the same small vector repeatedly: with feedback the sum of what
  // arrived tracks the sum of what was meant; without it the error grows.
  const std::vector<float> v(256, 0.001f);
  std::vector<float> residual(256, 0.0f);
  std::vector<float> with(256, 0.0f);
  std::vector<float> without(256, 0.0f);
  std::vector<float> mixed = v;
  mixed[0] = 1.0f;  // sets a coarse scale: 0.001 rounds to 0 without feedback
  for (int round = 0; round < 100; ++round) {
    const auto a = round_trip(WireDtype::kInt8, mixed, &residual);
    const auto b = round_trip(WireDtype::kInt8, mixed, nullptr);
    for (size_t i = 0; i < 256; ++i) {
      with[i] += a[i];
      without[i] += b[i];
    }
  }
  EXPECT_NEAR(with[5], 0.1f, 0.01f);
  EXPECT_EQ(without[5], 0.0f);
}

TEST(Codec, ShortMessagesAreErrors) {
  std::vector<std::byte> bytes(10);
  std::span<const std::byte> in(bytes);
  std::vector<float> out(4);
  EXPECT_FALSE(decode_floats(WireDtype::kFp32, in, out));
  EXPECT_EQ(parse_wire_dtype("fp8").error().kind, ErrorKind::kUsage);
  EXPECT_EQ(*parse_wire_dtype("int8"), WireDtype::kInt8);
}

TEST(Shards, CoverTheVectorOnSixteenFloatBoundaries) {
  for (size_t size : {size_t{1}, size_t{100}, size_t{235152}}) {
    for (int w : {1, 2, 3, 4, 7}) {
      const auto b = train::shard_bounds(size, w);
      ASSERT_EQ(b.size(), static_cast<size_t>(w) + 1);
      EXPECT_EQ(b.front(), 0u);
      EXPECT_EQ(b.back(), size);
      for (int j = 1; j < w; ++j) {
        EXPECT_LE(b[static_cast<size_t>(j) - 1], b[static_cast<size_t>(j)]);
        EXPECT_TRUE(b[static_cast<size_t>(j)] % 16 == 0 || b[static_cast<size_t>(j)] == size);
      }
    }
  }
}

TEST(World, ReadsTheLaunchersVariables) {
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
  unsetenv("OMPI_COMM_WORLD_RANK");
  unsetenv("OMPI_COMM_WORLD_SIZE");
  unsetenv("SLURM_PROCID");
  unsetenv("SLURM_NTASKS");
  EXPECT_FALSE(world_from_environment()->has_value());
  setenv("SLURM_PROCID", "3", 1);
  setenv("SLURM_NTASKS", "8", 1);
  auto slurm = world_from_environment();
  ASSERT_TRUE(slurm && slurm->has_value());
  EXPECT_EQ((*slurm)->rank, 3);
  EXPECT_EQ((*slurm)->size, 8);
  EXPECT_EQ((*slurm)->local_rank, 3);  // no local rank given: the rank
  setenv("SLURM_LOCALID", "1", 1);
  EXPECT_EQ((*world_from_environment())->local_rank, 1);
  unsetenv("SLURM_LOCALID");
  setenv("OMPI_COMM_WORLD_RANK", "1", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
  EXPECT_EQ((*world_from_environment())->size, 2);  // Open MPI's variables come before Slurm's
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "x", 1);
  auto bad = world_from_environment();
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error().kind, ErrorKind::kUsage);
  EXPECT_NE(bad.error().message.find("WORLD_SIZE"), std::string::npos);
  for (const char* name :
       {"RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"}) {
    unsetenv(name);
  }
}

TEST(World, OneRankIsSoloAndSeveralNeedARendezvous) {
  unsetenv("CFMO_RENDEZVOUS");
  auto solo = connect_world(std::nullopt, {});
  ASSERT_TRUE(solo) << solo.error().message;
  EXPECT_EQ((*solo)->size(), 1);
  WorldInfo two{1, 2, "RANK/WORLD_SIZE", false, 1};
  auto none = connect_world(two, {});
  ASSERT_FALSE(none);
  EXPECT_EQ(none.error().kind, ErrorKind::kUsage);
  EXPECT_EQ(none.error().message, "RANK/WORLD_SIZE says 2 ranks: set --rendezvous or CFMO_RENDEZVOUS");
}

}  // namespace
}  // namespace cfmo::comm
